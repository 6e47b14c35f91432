"""Convert a bf16 source checkpoint into the one a 4x RTX 3090 node serves (compose's ``convert`` profile).

``python -m service.convert --src SRC --out OUT --scratch DIR [--tp 4] [--ple-format fp8_e4m3]
[--expert-format w4a16] [--estimate-only]``

Two existing converters, in order: ``model.tools.ple_quantize`` (PLE tables to fp8_e4m3 or nvfp4: the
tables live in pinned host memory, 84 GiB in bf16 for the example config, 42 in fp8) into
``SCRATCH/ple-<format>``, then ``model.tools.quantize`` (routed experts to int4 W4A16 or FP8 blocks with
groups that tile each of ``--tp`` ranks) from there into ``OUT``; the intermediate is removed at
the end. Before anything is written the disk space each step needs is printed, computed from the
source's size on disk and the fit planner's byte counts for the formats asked for, and compared
with the free space of the filesystems holding ``SCRATCH`` and ``OUT``: a conversion that runs out
of space after an hour is the failure this avoids.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from model.runtime.expert_format import ExpertFormat
from model.tools.planner import load_config, ple_tables, weights_per_rank

GB = 10**9
EXIT_NO_SPACE = 4
EXPERT_FORMATS = {"w4a16": "int4", "fp8-block": "fp8"}  # model.tools.quantize --format -> planner name
GROUPS = (128, 64, 32)  # model.tools.quantize.GROUP_CHOICES: the largest that tiles every rank is used


@dataclass(frozen=True)
class DiskEstimate:
    source_bytes: int  # measured: the files of SRC
    intermediate_bytes: int  # SRC with the PLE tables converted
    output_bytes: int  # the servable checkpoint
    scratch_free: int
    out_free: int

    @property
    def fits(self) -> bool:
        if same_filesystem_free(self):
            return self.intermediate_bytes + self.output_bytes <= self.out_free
        return self.intermediate_bytes <= self.scratch_free and self.output_bytes <= self.out_free

    def table(self) -> str:
        rows = [
            ("source (read)", self.source_bytes, None),
            ("scratch: PLE-converted copy (removed at the end)", self.intermediate_bytes, self.scratch_free),
            ("output: servable checkpoint", self.output_bytes, self.out_free),
        ]
        lines = ["| step | size | free |", "|---|---:|---:|"]
        for name, size, free in rows:
            lines.append(f"| {name} | {human(size)} | {'' if free is None else human(free)} |")
        peak = self.source_bytes + self.intermediate_bytes + self.output_bytes
        lines.append(f"| peak on disk (source + both copies) | {human(peak)} | |")
        return "\n".join(lines)


def human(n: int) -> str:
    """GB (10^9) for real checkpoints, MB for the small test ones."""
    return f"{n / GB:,.1f} GB" if n >= GB else f"{n / 1e6:,.2f} MB"


def same_filesystem_free(est: DiskEstimate) -> bool:
    return est.scratch_free == est.out_free


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def expert_format(config, tp: int, fmt: str) -> ExpertFormat:
    """The planner's format for ``model.tools.quantize --format fmt`` with the group the quantizer picks."""
    name = EXPERT_FORMATS[fmt]
    for group in GROUPS:
        candidate = ExpertFormat(name, group)
        try:
            weights_per_rank(config, tp, candidate)
        except ValueError:
            continue
        return candidate
    raise ValueError(f"no group size in {GROUPS} tiles the experts at --tp {tp}")


def estimate(src: Path, scratch: Path, out: Path, tp: int, ple_format: str, fmt: str) -> DiskEstimate:
    config = load_config(src)
    source = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and ".cache" not in p.parts)
    ple = ple_tables(config, 1).bytes_total
    dense_bf16 = sum(p.bytes_per_rank for p in weights_per_rank(config, 1, "bf16"))
    quantized = sum(p.bytes_per_rank for p in weights_per_rank(config, 1, expert_format(config, tp, fmt)))
    intermediate = source - ple["bf16"] + ple[ple_format]
    # Tokenizer, config and anything else the source carries beyond the counted tensors is copied.
    other = max(source - dense_bf16 - ple["bf16"], 0)
    output = quantized + ple[ple_format] + other
    return DiskEstimate(source, intermediate, output, free_bytes(scratch), free_bytes(out))


def run(step: list[str]) -> None:
    print("convert: " + " ".join(step), flush=True)
    subprocess.run([sys.executable, "-m", *step], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="bf16 source checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="servable checkpoint to write")
    parser.add_argument("--scratch", type=Path, required=True, help="directory for the intermediate")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ple-format", choices=("fp8_e4m3", "nvfp4"), default="fp8_e4m3")
    parser.add_argument("--expert-format", choices=tuple(EXPERT_FORMATS), default="w4a16")
    parser.add_argument("--estimate-only", action="store_true", help="print the disk estimate and stop")
    args = parser.parse_args(argv)
    if not (args.src / "config.json").is_file():
        sys.stderr.write(
            f"convert: {args.src} has no config.json; fix: run the download profile first "
            "(QWEN4EXP_SOURCE_DIR)\n"
        )
        return 2
    if (args.out / "config.json").exists():
        sys.stderr.write(
            f"convert: {args.out} already holds a checkpoint; fix: empty QWEN4EXP_MODEL_DIR or point it "
            "at a new directory\n"
        )
        return 2
    try:
        est = estimate(args.src, args.scratch, args.out, args.tp, args.ple_format, args.expert_format)
    except ValueError as exc:
        sys.stderr.write(f"convert: {args.src}: {exc}; fix: a --tp whose per-rank shapes tile\n")
        return 2
    print(
        f"convert: disk estimate for {args.ple_format} PLE tables + {args.expert_format} experts at TP "
        f"{args.tp}:\n{est.table()}",
        flush=True,
    )
    if not est.fits:
        sys.stderr.write(
            "convert: not enough free space for the estimate above; fix: free space or point "
            "QWEN4EXP_SCRATCH_DIR / QWEN4EXP_MODEL_DIR at larger filesystems\n"
        )
        return EXIT_NO_SPACE
    if args.estimate_only:
        return 0
    stage = args.scratch / f"ple-{args.ple_format}"
    if stage.exists():
        shutil.rmtree(stage)  # a previous, interrupted run: its tables may be partial
    run(
        ["model.tools.ple_quantize", "--format", args.ple_format, "--src", str(args.src), "--out", str(stage)]
    )
    run(
        [
            "model.tools.quantize",
            "--src",
            str(stage),
            "--out",
            str(args.out),
            "--format",
            args.expert_format,
            "--tp",
            str(args.tp),
        ]
    )
    shutil.rmtree(stage)
    # The converters write 0600 files; the serving container's uid may differ from this one's.
    for path in args.out.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    print(f"convert: done: {args.out}; next: the calibrate profile (FP8 KV scales)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
