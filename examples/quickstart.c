/* The README's C quick start: the process-wide allocator (NULL), which uses
   a GPU when there is one and the simulated device otherwise. */
#include <ccalloc/ccalloc.h>

#include <stdint.h>
#include <stdio.h>

int main(void) {
  void* p = NULL;
  if (ccalloc_malloc(NULL, /*device=*/0, 64 << 20, /*stream=*/NULL, &p) != CCALLOC_OK) {
    fprintf(stderr, "%s\n", ccalloc_last_error());
    return 1;
  }
  int64_t peak = 0;
  ccalloc_get_device_stat(NULL, 0, "reserved_bytes.all.peak", &peak);
  printf("peak reserved: %lld bytes\n", (long long)peak);
  ccalloc_delete(NULL, p);

  /* Errors are status codes; the message names the C function to call. */
  ccalloc_allocator_t* a = NULL;
  if (ccalloc_create(NULL, &a) != CCALLOC_OK) return 1;
  if (ccalloc_malloc(a, 0, 512, NULL, &p) != CCALLOC_ERROR_INVALID_ARGUMENT) return 1;
  printf("as expected: %s\n", ccalloc_last_error());
  ccalloc_destroy(a);
  return peak >= (64 << 20) ? 0 : 1;
}
