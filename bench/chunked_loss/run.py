"""Benchmark: peak memory and time of the LM head + cross-entropy, chunked against full logits.

One forward + backward of ``xffl.training.chunked_loss.chunked_cross_entropy`` on random
final hidden states (tokens x hidden) through a bias-free head (vocabulary x hidden), with
``loss_chunk`` tokens per chunk and with 0 (the whole fp32 logits at once, the baseline), in
the same run. Peak memory is exact: on CUDA the allocator's peak (``max_memory_allocated``
above what was allocated before); on the CPU the peak of live tensor storages created by the
ops (:class:`PeakBytes`). Printed: each peak and median time, their ratios to the baseline,
and the model of the chunked peak, 3 x chunk x vocab x 4 B (+ the head's gradient twice).

    python bench/chunked_loss/run.py                                    # CPU, 4096 x 256 -> 32768
    python bench/chunked_loss/run.py --device cuda --dtype bf16 \\
        --tokens 8192 --hidden 4096 --vocab 128256                      # Llama-3.1-8B's head
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from xffl.training.chunked_loss import chunked_cross_entropy


class PeakBytes(TorchDispatchMode):
    """Exact peak of the bytes of tensor storages created inside the mode (forward and
    backward ops alike): each op's new output storages count until they are freed.

    torch's MemTracker refuses a module called more than once per iteration (the head is
    called once per chunk), hence this count of storages.
    """

    def __init__(self) -> None:
        """Nothing counted yet."""
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        """Run the op; count the storages of its outputs that are new."""
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:
                    self._seen[storage] = nbytes = storage.nbytes()
                    self.live += nbytes
                    weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def measure(args: argparse.Namespace, chunk: int) -> dict[str, float]:
    """Peak bytes and median seconds of forward + backward at ``chunk`` tokens per chunk."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen, device=device, dtype=dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
    head = nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)

    def once() -> None:
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        chunked_cross_entropy(h, head, targets, chunk).backward()

    if device.type == "cuda":
        once()  # warm-up (kernels, allocator)
        torch.cuda.synchronize(device)
        head.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        once()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with PeakBytes() as mem:
            once()
        peak = mem.peak
    times = []
    for _ in range(args.repeat):
        began = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return {"peak_bytes": float(peak), "seconds": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    """Run both variants and print their peaks, times and ratios (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    full = measure(args, 0)
    chunked = measure(args, args.chunk)
    model = 3 * args.chunk * args.vocab * 4 + 2 * args.vocab * args.hidden * 4
    result = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
              "chunk": args.chunk, "device": args.device, "dtype": args.dtype,
              "full": full, "chunked": chunked, "model_peak_bytes": model,
              "full_logits_fp32_bytes": args.tokens * args.vocab * 4,
              "peak_ratio": chunked["peak_bytes"] / full["peak_bytes"],
              "time_ratio": chunked["seconds"] / full["seconds"]}
    if args.json:
        print(json.dumps(result))
        return 0
    mib = 2.0 ** 20
    print(f"{args.tokens} tokens x {args.hidden} -> {args.vocab} ({args.dtype}, {args.device})")
    print(f"full logits : peak {full['peak_bytes'] / mib:9.1f} MiB  {full['seconds']:.3f} s")
    print(f"chunk {args.chunk:<6d}: peak {chunked['peak_bytes'] / mib:9.1f} MiB  "
          f"{chunked['seconds']:.3f} s  (model {model / mib:.1f} MiB)")
    print(f"ratios chunked / full: peak {result['peak_ratio']:.3f}, "
          f"time {result['time_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
