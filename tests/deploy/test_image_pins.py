"""Third-party images are pulled by digest, and ``deploy/pin_images.py`` keeps the pins.

No registry is reachable here, so the tool runs against a stand-in ``docker`` on PATH that answers
``buildx imagetools inspect`` from a table, as the real one answers with the index digest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TOOL = ROOT / "deploy" / "pin_images.py"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def pin(*args: str, root: Path | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    cmd = [sys.executable, str(TOOL), *args] + (["--root", str(root)] if root else [])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)


def listed(root: Path | None = None) -> dict[str, str]:
    """{file + tag: digest or UNPINNED} from ``--list``."""
    proc = pin("--list", root=root)
    assert proc.returncode in (0, 1), proc.stderr
    return {f"{f} {t}": d for f, t, d in (line.split() for line in proc.stdout.splitlines())}


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[Path, Path]:
    """A ``docker`` that answers imagetools inspect from ``answers.json`` ({tag: digest})."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    answers = tmp_path / "answers.json"
    script = bindir / "docker"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "assert args[:3] == ['buildx', 'imagetools', 'inspect'] and args[4:] == ['--format', '{{json .Manifest}}'], args\n"
        f"table = json.load(open({str(answers)!r}))\n"
        "if args[3] not in table:\n"
        "    sys.exit(f'ERROR: {args[3]}: not found')\n"
        "print(json.dumps({'mediaType': 'application/vnd.oci.image.index.v1+json', 'digest': table[args[3]]}))\n"
    )
    script.chmod(0o755)
    return bindir, answers


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the three files the tool edits."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("compose.yaml", ".env.example", "Dockerfile"):
        shutil.copy(ROOT / name, root / name)
    return root


def digest(n: int) -> str:
    return f"sha256:{n:064x}"


def test_the_stack_pulls_third_party_images_by_digest_where_one_was_confirmed():
    """Every pin is name:tag@sha256:<64 hex>; the refs still unpinned are exactly the ones
    docs/deployment.md names as pinned on the box by the tool."""
    refs = listed()
    assert refs, "no image references found"
    assert all(d == "UNPINNED" or DIGEST.fullmatch(d) for d in refs.values()), refs
    unpinned = sorted({key.split()[1] for key, d in refs.items() if d == "UNPINNED"})
    section = (
        (ROOT / "docs" / "deployment.md").read_text().split("### Images by digest", 1)[1].split("\n## ", 1)[0]
    )
    for tag in unpinned:
        assert f"`{tag}`" in section, f"{tag} is unpinned but docs/deployment.md does not say so"
    pinned = sum(d != "UNPINNED" for d in refs.values())
    assert pinned >= 6, refs
    # the gate's default in .env.example carries the same pin as compose.yaml's fallback
    gate = [d for key, d in refs.items() if "nginx-unprivileged" in key]
    assert len(gate) == 2 and len(set(gate)) == 1, gate


def test_pin_writes_digests_keeps_tags_and_is_idempotent(checkout: Path, fake_docker):
    bindir, answers = fake_docker
    before = listed(checkout)
    table = {key.split()[1]: digest(i + 1) for i, key in enumerate(sorted(before))}
    answers.write_text(json.dumps(table))
    path = f"{bindir}:{os.environ['PATH']}"

    proc = pin(root=checkout, path=path)
    assert proc.returncode == 0, proc.stderr
    after = listed(checkout)
    assert set(after) == set(before)
    for key, was in before.items():  # existing pins kept, missing ones filled from the registry
        assert after[key] == (was if was != "UNPINNED" else table[key.split()[1]]), key
    assert pin("--list", root=checkout).returncode == 0
    text = (checkout / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:13\.0\.2-base-ubuntu24\.04@sha256:[0-9a-f]{64} AS base$", text, re.M)
    assert re.search(r"^FROM base AS runtime$", text, re.M), "stage references must stay as they are"
    assert "image: ${QWEN4EXP_IMAGE:-qwen4exp-serve:0.1.0}" in (checkout / "compose.yaml").read_text()

    snapshot = {n: (checkout / n).read_text() for n in ("compose.yaml", ".env.example", "Dockerfile")}
    again = pin(root=checkout, path=path)
    assert again.returncode == 0 and "nothing to change" in again.stdout
    assert snapshot == {n: (checkout / n).read_text() for n in snapshot}

    # --check: a tag that moved is reported with the fix, not rewritten
    moved = next(iter(table))
    answers.write_text(json.dumps({**table, moved: digest(999)}))
    stale = {k: v for k, v in after.items() if k.split()[1] == moved}
    proc = pin("--check", root=checkout, path=path)
    assert proc.returncode == 1 and moved in proc.stdout and "--refresh" in proc.stdout, proc.stdout
    assert listed(checkout) == after
    proc = pin("--refresh", root=checkout, path=path)
    assert proc.returncode == 0, proc.stderr
    assert all(listed(checkout)[k] == digest(999) for k in stale)
    assert pin("--check", root=checkout, path=path).returncode == 0


def test_check_names_unpinned_refs(checkout: Path, fake_docker):
    bindir, answers = fake_docker
    answers.write_text(json.dumps({key.split()[1]: digest(7) for key in listed(checkout)}))
    proc = pin("--check", root=checkout, path=f"{bindir}:{os.environ['PATH']}")
    assert proc.returncode == 1
    assert "has no digest" in proc.stdout and "python3 deploy/pin_images.py" in proc.stdout


def test_errors_name_the_image_and_the_fix(checkout: Path, fake_docker, tmp_path: Path):
    bindir, answers = fake_docker
    answers.write_text("{}")  # the registry knows none of them
    proc = pin(root=checkout, path=f"{bindir}:{os.environ['PATH']}")
    assert proc.returncode != 0 and "cannot resolve" in proc.stderr and "not found" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = pin(root=checkout, path=str(empty))
    assert proc.returncode != 0 and "docker not found on PATH" in proc.stderr
    compose = checkout / "compose.yaml"
    compose.write_text(
        compose.read_text().replace("prom/prometheus:v2.55.1@sha256:", "prom/prometheus@sha256:")
    )
    proc = pin("--list", root=checkout)
    assert proc.returncode == 2 and "name the release tag too" in proc.stderr
