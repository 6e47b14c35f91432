"""Pin the third-party images of the stack to registry digests, or check the pins.

A tag can be pushed again; a digest cannot. compose.yaml, .env.example and the Dockerfile name each
third-party image as ``name:tag@sha256:...``: the tag says which release it is, the digest is what
Docker pulls (the tag is then ignored). This tool resolves tags to their current digests with
``docker buildx imagetools inspect`` (the multi-platform index digest, the one ``docker pull`` prints),
so it needs Docker with buildx and access to the registries:

    python3 deploy/pin_images.py            # pin what has no digest yet; keep existing pins
    python3 deploy/pin_images.py --refresh  # re-resolve every tag (after changing a tag, or to update)
    python3 deploy/pin_images.py --check    # exit 1 if a ref has no digest or its tag moved
    python3 deploy/pin_images.py --list     # offline: each ref and its pin (exit 1 if one has none)

The service's own image (built from this Dockerfile, ``QWEN4EXP_IMAGE``) is not a pull and is left
alone; pin a pushed copy of it with the chart's ``image.digest``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("compose.yaml", ".env.example", "Dockerfile")
OWN_IMAGE = "qwen4exp-serve"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

# Where a reference sits in each file: the reference is group "ref" (no spaces, no variables).
PATTERNS = {
    "compose.yaml": re.compile(r"^(\s*image:\s*(?:\$\{[A-Z0-9_]+:-)?)(?P<ref>[^\s$}]+)", re.M),
    ".env.example": re.compile(r"^([A-Z0-9_]+_IMAGE=)(?P<ref>\S+)", re.M),
    "Dockerfile": re.compile(r"^(FROM\s+(?:--platform=\S+\s+)?)(?P<ref>[^\s$]+)", re.M | re.I),
}


@dataclass
class Ref:
    """One image reference found in one file."""

    file: str
    start: int
    end: int
    text: str

    @property
    def tag(self) -> str:
        return self.text.split("@", 1)[0]

    @property
    def digest(self) -> str | None:
        _, at, digest = self.text.partition("@")
        return digest if at else None


def find_refs(root: Path) -> list[Ref]:
    """Every pulled third-party image reference (Dockerfile stage names and our image skipped)."""
    refs = []
    for name in FILES:
        path = root / name
        if not path.exists():
            continue
        text = path.read_text()
        stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
        for m in PATTERNS[name].finditer(text):
            ref = m.group("ref")
            if ref in stages or ref.split(":")[0].split("@")[0] == OWN_IMAGE:
                continue
            refs.append(Ref(name, m.start("ref"), m.end("ref"), ref))
    return refs


def check_form(ref: Ref) -> str | None:
    """Why a reference is malformed, or None."""
    if ":" not in ref.tag.rsplit("/", 1)[-1]:
        return f"{ref.file}: {ref.text}: name the release tag too (name:tag@sha256:...)"
    if ref.digest is not None and not DIGEST.fullmatch(ref.digest):
        return f"{ref.file}: {ref.text}: the digest must be sha256: and 64 hex digits"
    return None


def resolve(tag: str) -> str:
    """The index digest the registry serves for ``tag`` now."""
    docker = shutil.which("docker")
    if docker is None:
        raise SystemExit(
            "pin_images: docker not found on PATH; run this where Docker with buildx can reach the registries"
        )
    proc = subprocess.run(
        [docker, "buildx", "imagetools", "inspect", tag, "--format", "{{json .Manifest}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"pin_images: cannot resolve {tag}: {proc.stderr.strip() or proc.stdout.strip()}")
    try:
        digest = json.loads(proc.stdout)["digest"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"pin_images: unexpected answer for {tag}: {proc.stdout[:200]!r}") from None
    if not DIGEST.fullmatch(digest):
        raise SystemExit(f"pin_images: unexpected digest for {tag}: {digest!r}")
    return digest


def rewrite(root: Path, pins: list[tuple[Ref, str]]) -> None:
    """Write ``tag@digest`` over each pinned reference, from the end of each file backwards so the
    offsets of the earlier ones stay valid."""
    for name in FILES:
        mine = sorted(((r, d) for r, d in pins if r.file == name), key=lambda p: -p[0].start)
        if not mine:
            continue
        path = root / name
        text = path.read_text()
        for r, digest in mine:
            text = text[: r.start] + f"{r.tag}@{digest}" + text[r.end :]
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--refresh", action="store_true", help="re-resolve every tag, pinned or not")
    mode.add_argument("--check", action="store_true", help="exit 1 if a ref is unpinned or its tag moved")
    mode.add_argument("--list", action="store_true", help="print the refs and pins without the network")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)

    refs = find_refs(args.root)
    bad = [msg for r in refs if (msg := check_form(r))]
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    if args.list:
        for r in refs:
            print(f"{r.file:14} {r.tag:60} {r.digest or 'UNPINNED'}")
        return 1 if any(r.digest is None for r in refs) else 0

    resolved: dict[str, str] = {}
    pins: list[tuple[Ref, str]] = []
    problems = []
    for r in refs:
        if not (args.refresh or args.check) and r.digest is not None:
            continue
        if r.tag not in resolved:
            resolved[r.tag] = resolve(r.tag)
        now = resolved[r.tag]
        if args.check:
            if r.digest is None:
                problems.append(
                    f"{r.file}: {r.tag} has no digest (now {now}); run: python3 deploy/pin_images.py"
                )
            elif r.digest != now:
                problems.append(
                    f"{r.file}: {r.tag} is pinned to {r.digest} but the tag now points to {now}; "
                    "review the release, then: python3 deploy/pin_images.py --refresh"
                )
        elif r.digest != now:
            pins.append((r, now))
            print(f"{r.file}: {r.tag} -> {now}" + (f" (was {r.digest})" if r.digest else ""))
    if args.check:
        print("\n".join(problems) or f"all {len(refs)} image references pinned and current")
        return 1 if problems else 0
    rewrite(args.root, pins)
    if not pins:
        print(f"nothing to change: all {len(refs)} image references pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
