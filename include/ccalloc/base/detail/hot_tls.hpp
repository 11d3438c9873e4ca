// ccalloc/base/detail/hot_tls.hpp: CCALLOC_HOT_TLS, the TLS model of the
// thread-locals that malloc and free read on every call (a thread's cache
// record, its last stream, its statistics tag). Not part of the public API.
//
// In a shared library (libccalloc.so, which PyTorch, CuPy and the Python
// bindings load) the compiler's default model for a thread-local is
// general-dynamic: every access calls __tls_get_addr (measured: about a
// tenth of the instructions of a cached alloc+free pair through the C API).
// initial-exec reads it at a fixed offset from the thread pointer, as in a
// program, at the price of a few bytes of the static TLS block that the C
// library reserves for libraries loaded after start-up (dlopen): these
// thread-locals take under 64 bytes, far below what glibc keeps for that,
// and memory allocators (jemalloc, tcmalloc, mimalloc) do the same.
#pragma once

#if defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define CCALLOC_HOT_TLS [[gnu::tls_model("initial-exec")]]
#else
#define CCALLOC_HOT_TLS
#endif
