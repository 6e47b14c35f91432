"""Download a checkpoint from the Hugging Face Hub into a directory (compose's ``download`` profile).

``python -m service.download REPO [--revision REV] --local-dir DIR``

The transfer itself is ``huggingface_hub.snapshot_download``: it resumes partial files, skips files
already complete in ``DIR`` (so re-running after an interruption fetches only what is missing; a
file whose size differs from the hub's is removed first, so it is fetched again) and
reads the token from ``HF_TOKEN_PATH`` (compose mounts it as a secret). This module adds what the
deployment needs around it, before a byte is transferred: the repository and revision are checked,
the size of the files is compared with the free space of ``DIR`` (a 270 GB download that fails at
90% wastes hours), and the commit that was downloaded is printed so it can be pinned.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

GB = 10**9
EXIT_USAGE = 2


def free_bytes(path: Path) -> int:
    """Free space of the filesystem that holds ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def missing_bytes(sizes: dict[str, int], local_dir: Path) -> int:
    """Bytes still to fetch: files absent from ``local_dir`` or of a different size there."""
    total = 0
    for name, size in sizes.items():
        path = local_dir / name
        if not path.is_file() or path.stat().st_size != size:
            total += size
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.download", description=__doc__.split("\n")[0])
    parser.add_argument("repo", help="repository id, e.g. org/name (compose: QWEN4EXP_HF_REPO)")
    parser.add_argument("--revision", default="main", help="branch, tag or commit (pin a commit)")
    parser.add_argument("--local-dir", type=Path, required=True)
    parser.add_argument("--allow-pattern", action="append", default=None, help="only these files (glob)")
    args = parser.parse_args(argv)
    if not args.repo.strip() or args.repo.count("/") != 1:
        sys.stderr.write(
            f"download: repository id {args.repo!r} is not of the form org/name; "
            "fix: set QWEN4EXP_HF_REPO in .env\n"
        )
        return EXIT_USAGE
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        sys.stderr.write("download: HF_HUB_OFFLINE is set; fix: HF_HUB_OFFLINE=0 for this step\n")
        return EXIT_USAGE

    from huggingface_hub import HfApi, snapshot_download

    info = HfApi().model_info(args.repo, revision=args.revision, files_metadata=True)
    sizes = {
        s.rfilename: int(s.size or 0)
        for s in info.siblings or []
        if args.allow_pattern is None or any(Path(s.rfilename).match(p) for p in args.allow_pattern)
    }
    total = sum(sizes.values())
    todo = missing_bytes(sizes, args.local_dir)
    free = free_bytes(args.local_dir)
    print(
        f"download: {args.repo}@{info.sha} ({args.revision}): {len(sizes)} files, {total / GB:,.1f} GB; "
        f"still to fetch {todo / GB:,.1f} GB; free at {args.local_dir}: {free / GB:,.1f} GB",
        flush=True,
    )
    if todo > free:
        sys.stderr.write(
            f"download: not enough space at {args.local_dir}: {todo / GB:,.1f} GB to fetch, "
            f"{free / GB:,.1f} GB free; fix: point QWEN4EXP_SOURCE_DIR at a larger filesystem\n"
        )
        return EXIT_USAGE
    # A file of the wrong size (a copy cut short by a full disk, an edited file) would be kept by
    # the library, which trusts its own metadata for completed files: remove it so it is fetched.
    for name, size in sizes.items():
        local = args.local_dir / name
        if local.is_file() and local.stat().st_size != size:
            print(f"download: {name}: {local.stat().st_size} bytes here, {size} on the hub: fetching again")
            local.unlink()
    # The commit, not the branch name: a branch that moves during a resumed download mixes files.
    path = snapshot_download(
        args.repo, revision=info.sha, local_dir=args.local_dir, allow_patterns=args.allow_pattern
    )
    print(f"download: complete: {path} holds {args.repo} at commit {info.sha}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
