#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention over contiguous bf16 KV, at the shape
of the worker's paged decode bench (batch 64, context 4096, 32 query heads,
8 KV heads, head dim 128), and the device-to-device copy bandwidth in the
same process. Grouped-query decode is run as 4 query rows per KV head (the
group), so no KV is repeated. Prints one line per figure."""
import torch
import torch.nn.functional as F

B, T, HQ, HKV, D = 64, 4096, 32, 8, 128
G = HQ // HKV
ITERS = 50


def timed(fn, iters=ITERS):
    for _ in range(3):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters  # ms


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(B, HKV, G, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) * 0.5
    v = torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) * 0.5
    ms = timed(lambda: F.scaled_dot_product_attention(q, k, v))
    kv_bytes = 2 * B * HKV * T * D * 2
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = min(timed(lambda: dst.copy_(src), 1) for _ in range(10))
    copy_gbps = 2 * src.numel() / (copy_ms * 1e-3) / 1e9
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    print(f"sdpa_time_us {ms * 1e3:.1f}")
    print(f"sdpa_gbps {gbps:.0f}")
    print(f"torch_copy_gbps {copy_gbps:.0f}")
    print(f"sdpa_over_copy {gbps / copy_gbps:.2f}")


if __name__ == "__main__":
    main()
