"""Checkpoints of tools/replay.py: one unit per save, verified before a resume.

[Note: replay checkpoint as one unit]
A replay's checkpoint is three runs' weights and AdamW state plus the rows so far; it is only
meaningful as a set (weights of step 6 with the rows of step 5 train step 6 twice, and the
paper's table then reports a wrong difference: issue 22). So every save writes a new directory
`step_NNNNNN/` -- the runs' `.safetensors`, `state.json` (settings and rows), and last
`manifest.json` (the step and the SHA-256 and size of every file) -- and only then points
`LATEST` at it (a one-line file written to a temporary name and renamed: atomic), and removes
the older step directories. A kill at any moment leaves `LATEST` naming a complete checkpoint.
A resume reads `LATEST`, checks every file against the manifest and the rows and AdamW step
counts against the step, and refuses (ValueError naming the file and what to do) anything
missing, truncated, corrupt, malformed or from other settings; it never starts over silently.
The trace is identified by its content (SHA-256), not its path.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

__all__ = ["save_checkpoint", "load_checkpoint", "load_runs", "trace_digest", "FORMAT"]

FORMAT = 1
LATEST = "LATEST"
_NOT_RESUMABLE = "use another --checkpoint-dir, or run without --resume to start over"


def trace_digest(path: Path) -> str:
    """SHA-256 of the trace file's bytes (what a resumed replay must be given again)."""
    return _sha256(Path(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(directory: Path, settings: dict, runs: dict, rows: list) -> Path:
    """Write the checkpoint after `len(rows)` steps as one unit (see the note); returns its
    directory."""
    directory.mkdir(parents=True, exist_ok=True)
    step_dir = directory / f"step_{len(rows):06d}"
    if step_dir.exists():  # a save of this step that was interrupted before LATEST named it
        shutil.rmtree(step_dir)
    step_dir.mkdir()
    files = {}
    for name, run in runs.items():
        path = step_dir / f"{name}.safetensors"
        run.save(path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.name] = path
    state = step_dir / "state.json"
    _write_synced(state, json.dumps({"settings": settings, "rows": rows}, indent=1).encode())
    files[state.name] = state
    manifest = {"format": FORMAT, "step": len(rows),
                "files": {n: {"sha256": _sha256(p), "bytes": p.stat().st_size}
                          for n, p in files.items()}}
    _write_synced(step_dir / "manifest.json", json.dumps(manifest, indent=1).encode())
    pointer = directory / f"{LATEST}.tmp"
    _write_synced(pointer, (step_dir.name + "\n").encode())
    pointer.replace(directory / LATEST)  # the commit point
    for old in directory.glob("step_*"):
        if old.is_dir() and old != step_dir:
            shutil.rmtree(old, ignore_errors=True)
    return step_dir


def load_checkpoint(directory: Path, settings: dict, *, steps: int) -> tuple:
    """(rows, step directory) of the verified checkpoint in `directory` (load the runs with
    `load_runs`); ValueError if there is none, it is partial or corrupt, from other settings,
    or past `steps`. Reads no weights: cheap enough to run before the models are built."""
    step_dir = _latest(directory)
    manifest = _manifest(step_dir)
    for name, entry in manifest["files"].items():
        _verify(step_dir / name, entry)
    state = _json(step_dir / "state.json")
    if (not isinstance(state, dict) or not isinstance(state.get("settings"), dict)
            or not isinstance(state.get("rows"), list)):
        raise ValueError(f"{step_dir / 'state.json'} is not a replay state ({{settings, rows}}); "
                         + _NOT_RESUMABLE)
    rows = state["rows"]
    if len(rows) != manifest["step"]:
        raise ValueError(f"{step_dir} holds {len(rows)} rows for step {manifest['step']}; "
                         + _NOT_RESUMABLE)
    _check_settings(directory, state["settings"], settings)
    if len(rows) > steps:
        raise ValueError(f"{directory} holds a replay after {len(rows)} steps, past --steps "
                         f"{steps}; use --steps >= {len(rows)} or another --checkpoint-dir")
    return rows, step_dir


def load_runs(step_dir: Path, runs: dict, steps: int) -> None:
    """Load every run's weights and AdamW state from the checkpoint `step_dir` (after `steps`
    steps); ValueError if a file is unreadable or not this replay's."""
    for name, run in runs.items():
        _load_run(run, step_dir / f"{name}.safetensors", steps)


def _latest(directory: Path) -> Path:
    pointer = directory / LATEST
    if not pointer.is_file():
        what = ("holds a checkpoint of an older replay.py (no LATEST, no manifest)"
                if (directory / "state.json").exists() else "holds no replay checkpoint")
        raise ValueError(f"--resume: {directory} {what}; {_NOT_RESUMABLE}")
    name = pointer.read_text(errors="replace").strip()
    step_dir = directory / name
    if not name.startswith("step_") or "/" in name or not step_dir.is_dir():
        raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint directory in "
                         f"{directory}; {_NOT_RESUMABLE}")
    return step_dir


def _json(path: Path):
    if not path.is_file():
        raise ValueError(f"{path} is missing or not a file; the checkpoint is partial: "
                         + _NOT_RESUMABLE)
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); {_NOT_RESUMABLE}") from None


def _manifest(step_dir: Path) -> dict:
    manifest = _json(step_dir / "manifest.json")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("step"), int) or "state.json" not in files
            or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                       and isinstance(e.get("bytes"), int) for e in files.values())):
        raise ValueError(f"{step_dir / 'manifest.json'} is not a replay checkpoint manifest "
                         f"(format {FORMAT}: step, files with sha256 and bytes); "
                         + _NOT_RESUMABLE)
    return manifest


def _verify(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise ValueError(f"{path} is missing; the checkpoint is partial: {_NOT_RESUMABLE}")
    size = path.stat().st_size
    if size != entry["bytes"] or _sha256(path) != entry["sha256"]:
        raise ValueError(f"{path} does not match the checkpoint's manifest ({size} bytes, "
                         f"manifest {entry['bytes']}; or a different SHA-256): it is truncated "
                         f"or was changed; {_NOT_RESUMABLE}")


def _check_settings(directory: Path, saved: dict, wanted: dict) -> None:
    ignore = ("steps", "trace")  # the path may move; the content (trace_sha256) may not
    keep = lambda d: {k: v for k, v in d.items() if k not in ignore}  # noqa: E731
    if keep(saved) != keep(wanted):
        diff = sorted(k for k in keep(wanted) if saved.get(k) != wanted[k])
        diff += sorted(k for k in keep(saved) if k not in wanted)
        hint = (" (the trace's content differs from the one the checkpoint was made with)"
                if "trace_sha256" in diff else "")
        raise ValueError(f"{directory} holds a replay with other settings ({diff}){hint}; use "
                         "another --checkpoint-dir or the same arguments and trace")


def _load_run(run, path: Path, steps: int) -> None:
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc}); "
                         + _NOT_RESUMABLE) from None
    missing = [k for k in run.state_tensors() if k.startswith("w.") and k not in tensors]
    if missing:
        raise ValueError(f"{path} lacks {missing[:3]}: it is not this replay's model; "
                         + _NOT_RESUMABLE)
    counts = {float(v.reshape(-1)[0]) for k, v in tensors.items() if k.startswith("step.")}
    if counts != ({float(steps)} if steps else set()):
        raise ValueError(f"{path} holds AdamW state after {sorted(counts)} steps, the rows "
                         f"after {steps}; the checkpoint is inconsistent: {_NOT_RESUMABLE}")
    run.load_state_tensors(tensors)
