"""GPU benchmark of the hyper-connection gate mix: upstream's kernel against ours (reference rounding).

Run on a CUDA machine with vLLM's CUDA build, from the repository root:

    PYTHONPATH=. python3 bench/gpu_hc_gate_mix.py [--hc 4] [--hidden 2048]

Both kernels read the same ``xn`` and gate ``[T, hc * hidden]`` and write ``[T, hidden]`` in one
launch; ours adds two roundings to bf16 per stream (``model/upstream/hc_mix.py``). Times each at the
real width (4 streams of 2048) for decode batches and a prefill, side by side in one run, with
``triton.testing.do_bench`` (median, launch included), and prints the ratio. Timing only: the
rounding itself is judged in ``tests/upstream/test_upstream_hc_mix.py``.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

from model.upstream import hc_mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hc", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", default="1,16,64,256,2048")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    from vllm.models.qwen4_exp.nvidia.ops import hc as upstream_hc

    rows = []
    for tokens in map(int, args.tokens.split(",")):
        xn = torch.randn(tokens, args.hc * args.hidden, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn_like(xn)
        times = {}
        for name, fn in (("upstream", upstream_hc._hc_gate_mix), ("ours", hc_mix.gate_mix)):
            call = functools.partial(fn, xn, gate, args.hc)
            times[name] = triton.testing.do_bench(call, return_mode="median")
        up, ours = times["upstream"], times["ours"]
        rows.append(
            {
                "tokens": tokens,
                "upstream_us": 1e3 * up,
                "ours_us": 1e3 * ours,
                "ours_over_upstream": ours / up,
            }
        )
    print(f"hc gate mix, {args.hc} streams of {args.hidden}, {torch.cuda.get_device_name()}")
    print("| tokens | upstream (us) | ours, reference rounding (us) | ours / upstream |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['upstream_us']:.2f} | {r['ours_us']:.2f} | {r['ours_over_upstream']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
