"""The README's Python quick start, on a simulated device (no GPU needed).

With a GPU and PyTorch, ``import ccalloc.torch; ccalloc.torch.install()``
before CUDA is used makes ccalloc PyTorch's allocator instead.
"""
import ccalloc

MiB = 1 << 20

with ccalloc.Allocator(backend="sim", capacity_bytes=1024 * MiB) as alloc:
    ptr = alloc.malloc(64 * MiB)
    alloc.free(ptr)                      # cached for the next request
    print("peak reserved:", alloc.stat("reserved_bytes.all.peak"), "bytes")
    try:
        alloc.malloc(4096 * MiB)         # more than the device has
    except ccalloc.OutOfMemoryError as e:
        print("caught:", str(e)[:60], "...")
    assert alloc.stat("num_ooms") == 1
