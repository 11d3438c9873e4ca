/* pause_before_rename.c: an LD_PRELOAD library for tests/cli_output_files.sh
 * (cases "signal", "report_oom_snapshot"). It replaces rename(3): a rename
 * of a temporary output file (a name holding ".tmp."), with
 * CCALLOC_TEST_PAUSED set, first creates the file it names (telling the
 * test that the temporary file is complete and the write is in progress)
 * and then waits for a signal forever, so that the test's SIGTERM arrives
 * at a known point of the write; with CCALLOC_TEST_RENAMES set, appends the
 * target's name and a newline to the file it names (counting the outputs
 * written) and renames. Any other rename is the C library's. Test code
 * only: nothing in ccalloc knows of it. */
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
  const char* renames = getenv("CCALLOC_TEST_RENAMES");
  if (renames != NULL && strstr(from, ".tmp.") != NULL) {
    const int fd = open(renames, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      (void)!write(fd, to, strlen(to));
      (void)!write(fd, "\n", 1);
      close(fd);
    }
  }
  int (*real_rename)(const char*, const char*) = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
  return real_rename(from, to);
}
