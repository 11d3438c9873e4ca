// ccalloc/core/file_output.hpp: writing an output file whole, or not at all.
//
// The snapshot writers (the configuration's oom_snapshot, the CLI's
// --snapshot and report -o) replace a file the user may care about: a
// write that fails part way (a full disk, a file size limit) must leave the
// old file as it was, and a check made before a long run must create,
// remove or open nothing. Standard library and POSIX only.
//
// What a path names decides how it is written:
// - a regular file, or nothing yet: a new temporary file in the same folder
//   (`<file>.tmp.<pid>.<count>`, created exclusively and never through a
//   link) is written whole, closed, and renamed over the file; on any
//   failure it is removed and the old file stays. The new file keeps the
//   old one's permission bits (a new one gets 0666 less the umask).
// - a symbolic link (a chain of them, dangling or not): the same, at the
//   file the links lead to; the links themselves are left alone.
// - anything else (a FIFO, a character device such as /dev/null or
//   /dev/full) and every path under /dev/ or /proc/ (/dev/stdout and
//   /dev/fd/N name open descriptors): written in place. A FIFO is opened
//   without waiting: with no reader the write fails at once (ENXIO, "a
//   FIFO with no reader") rather than blocking the caller.
//
// A signal that kills the program during a write (SIGTERM, SIGINT) would
// leave the temporary file: a program removes it in its own handler with
// remove_temporary_files, which may be called from a signal handler. The
// library installs no signal handler (it does not change a program's
// signal handling).
//
// Thread safety: write_file_whole and check_file_writable may run at once
// on any threads, the same path included (each writer has its own
// temporary file; the last rename wins); remove_temporary_files at any
// time, on any thread or in a signal handler. Cost: one write of the
// bytes; a few stat calls.
#pragma once

#include <string>
#include <string_view>

namespace ccalloc {

/// Writes `bytes` to `path` as the file comment says. Returns 0, or the
/// errno of the failed step with that step's words in `step`, to be put
/// after the path: ": cannot create a temporary file in <folder>", ": cannot
/// write a temporary file in <folder>", ": a FIFO with no reader" (ENXIO),
/// or "" (opening or renaming the file itself). An existing file that is
/// not writable (access(W_OK)) is not replaced (EACCES), as an in-place
/// write would not. Throws std::bad_alloc only (building names).
int write_file_whole(const std::string& path, std::string_view bytes, std::string& step);

/// Whether write_file_whole(path, ...) can be expected to succeed, checked
/// without creating, removing or opening anything (a FIFO's reader would
/// see end-of-file if it were opened and closed): the file (or the file its
/// links lead to) is no directory and is writable, and for a regular file
/// or none the folder exists and is writable. Returns 0 or an errno, with
/// `step` as write_file_whole's (": cannot create a temporary file in
/// <folder>" when the folder is not writable). A FIFO's reader is not
/// checked: it must be there when the file is written.
int check_file_writable(const std::string& path, std::string& step);

/// Removes (unlinks) the temporary file of every write_file_whole running
/// now in this process, for a program's handler of a signal that ends it
/// (SIGTERM, SIGINT, SIGHUP: the handler calls this, then lets the signal's
/// default action end the program). The writes in progress then fail
/// (ENOENT at the rename) and leave the old files as they were. Each
/// writer publishes its temporary file's path in a fixed table of 16 slots
/// of lock-free atomics, before the file is created and until it is
/// renamed or removed; a writer beyond 16 at once, or with a temporary path
/// of 4096 bytes or more, is not published and its file is not removed.
/// Async-signal-safe (atomics and unlink(2) only), noexcept, callable from
/// any thread at any time; a path taken by a call stays taken (its slot is
/// not reused), since the program is expected to end.
void remove_temporary_files() noexcept;

}  // namespace ccalloc
