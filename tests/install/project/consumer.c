/* Uses the installed C API (plain C99) on a simulated device and on the
 * process-wide allocator. Exits non-zero on the first wrong value. */
#include <ccalloc/ccalloc.h>

#include <stdio.h>
#include <string.h>

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      printf("consumer_c: %s failed (line %d): %s\n", #cond, __LINE__, ccalloc_last_error()); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

int main(void) {
  ccalloc_options_t options;
  ccalloc_allocator_t* alloc = NULL;
  void* p = NULL;
  int64_t reserved = 0;
  char config[256];
  size_t length = 0;

  ccalloc_options_init(&options);
  options.backend = CCALLOC_BACKEND_SIM;
  options.sim_capacity_bytes = (size_t)1 << 30;
  options.config = "max_split_size_mb:64,expandable_segments:False"; /* plain: one 20 MiB segment */
  CHECK(ccalloc_create(&options, &alloc) == CCALLOC_OK);
  CHECK(ccalloc_init(alloc, 1) == CCALLOC_OK);
  CHECK(ccalloc_malloc(alloc, 0, ((size_t)1 << 20) + 1, NULL, &p) == CCALLOC_OK && p != NULL);
  CHECK(ccalloc_get_device_stat(alloc, 0, "reserved_bytes.all.current", &reserved) == CCALLOC_OK);
  CHECK(reserved == (int64_t)20 << 20);
  CHECK(ccalloc_delete(alloc, p) == CCALLOC_OK);
  CHECK(ccalloc_delete(alloc, p) == CCALLOC_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ccalloc_last_error(), "not a live allocation") != NULL);
  CHECK(ccalloc_get_config(alloc, config, sizeof config, &length) == CCALLOC_OK);
  CHECK(strstr(config, "max_split_size_mb:64") != NULL);
  CHECK(strstr(config, "expandable_segments:False") != NULL);
  ccalloc_destroy(alloc);

  p = ccalloc_plugin_alloc(4096, 0, NULL); /* PyTorch's entry points, process-wide allocator */
  CHECK(p != NULL);
  ccalloc_plugin_free(p, 4096, 0, NULL);
  printf("consumer_c: ok (%s %s)\n", ccalloc_name(), ccalloc_version());
  return 0;
}
