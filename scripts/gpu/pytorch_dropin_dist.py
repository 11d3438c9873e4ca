#!/usr/bin/env python3
"""One rank of a distributed drop-in check (scripts/gpu/pytorch_dropin.py starts
it with torchrun on 2 GPUs): MODE ddp | fsdp2 | nccl_pool. DROPIN_ALLOCATOR
ccalloc | native picks the allocator; rank 0 writes the per-step losses to
DROPIN_OUT (one a line)."""
import os
import sys

if os.environ.get("DROPIN_ALLOCATOR") == "ccalloc":
    import ccalloc.torch

    ccalloc.torch.install()
import torch
import torch.distributed as dist


def model_and_data(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)) for _ in range(10)]
    return model, data


def main() -> int:
    mode = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    model, data = model_and_data(rank)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    pool_buf = None
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif mode == "nccl_pool":
        import ccalloc

        pool = ccalloc.torch.MemPool(segment_allocator=ccalloc.nccl_segment_allocator())
        with ccalloc.torch.use_mem_pool(pool):
            pool_buf = torch.zeros(sum(p.numel() for p in model.parameters()), device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        x, y = x.cuda().to(torch.bfloat16), y.cuda().to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if pool_buf is not None:  # gradients all-reduced through the ncclMemAlloc buffer
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            pool_buf.copy_(flat)
            dist.all_reduce(pool_buf)
            pool_buf /= dist.get_world_size()
            offset = 0
            for p in model.parameters():
                p.grad.copy_(pool_buf[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().float()
        dist.all_reduce(avg)
        losses.append(avg.item() / dist.get_world_size())
    if rank == 0:
        with open(os.environ["DROPIN_OUT"], "w") as f:
            f.write("\n".join(f"{v:.6f}" for v in losses))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
