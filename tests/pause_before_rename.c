/* pause_before_rename.c: an LD_PRELOAD library for tests/cli_output_files.sh
 * (case "signal"). It replaces rename(3): a rename of a temporary output
 * file (a name holding ".tmp.") first creates the file named by
 * CCALLOC_TEST_PAUSED (telling the test that the temporary file is complete
 * and the write is in progress) and then waits for a signal forever, so that
 * the test's SIGTERM arrives at a known point of the write. Any other
 * rename is the C library's. Test code only: nothing in ccalloc knows of it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int rename(const char* from, const char* to) {
  const char* marker = getenv("CCALLOC_TEST_PAUSED");
  if (marker != NULL && strstr(from, ".tmp.") != NULL) {
    const int fd = open(marker, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) close(fd);
    for (;;) pause();
  }
  int (*real_rename)(const char*, const char*) = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
  return real_rename(from, to);
}
