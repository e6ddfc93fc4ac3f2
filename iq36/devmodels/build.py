"""Build a dev model offline and deterministically, cached by content key.

Steps, each in its own subprocess so peak memory stays that of one step (and is measured):
1. checkpoint: tokenizer from the Qwen BPE ranks + a random-init `Qwen3_5MoeForCausalLM`
   (seeded), saved as a Hugging Face checkpoint (shared by the int4 and f32 exports);
2. export: the stock exporter, `optimum-cli export openvino --task text-generation-with-past`,
   which also converts tokenizer and detokenizer with openvino-tokenizers;
3. lock: `manifest.json` (sha256 of every file, weight formats, runtime identity).
A build goes to a staging dir and is renamed into place only when complete.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from iq36 import manifest, paths
from iq36.devmodels.recipes import Recipe, checkpoint_key, get_recipe, model_key


class BuildError(Exception):
    pass


def default_dir(name: str) -> Path:
    recipe = get_recipe(name)
    return paths.models_dir() / f"{recipe.name}-{model_key(recipe)}"


def checkpoint_dir(recipe: Recipe) -> Path:
    return paths.checkpoints_dir() / f"{recipe.name.removesuffix('-f32')}-{checkpoint_key(recipe)}"


def cached(name: str) -> Path | None:
    """The cached build of a dev model if it exists and is complete, else None."""
    path = default_dir(name)
    return path if (path / manifest.MANIFEST).is_file() else None


class _Steps:
    """Progress of a build: a live line with elapsed seconds on a terminal, one line per step
    otherwise (CI logs)."""

    def __init__(self, title: str, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self._live = enabled and sys.stderr.isatty()
        self._plain = enabled and not self._live
        self._title, self._total, self._n = title, total, 0
        self._bar = tqdm(total=total, desc=title, disable=not self._live, file=sys.stderr,
                         bar_format="{desc} [{n_fmt}/{total_fmt}] {postfix}")
        self._label = ""
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="build-progress", daemon=True)
        if self._live:
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._bar.set_postfix_str(f"{self._label} {time.monotonic() - self._t0:.0f}s")

    def start(self, label: str) -> None:
        self._label, self._t0 = label, time.monotonic()
        self._bar.set_postfix_str(label)
        if self._plain:
            print(f"{self._title} [{self._n + 1}/{self._total}] {label} ...", file=sys.stderr,
                  flush=True)

    def done(self) -> float:
        elapsed = time.monotonic() - self._t0
        self._n += 1
        self._bar.update(1)
        if self._plain:
            print(f"{self._title} [{self._n}/{self._total}] {self._label}: {elapsed:.0f}s",
                  file=sys.stderr, flush=True)
        return elapsed

    def close(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self._bar.close()


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise BuildError(f"step failed (exit {proc.returncode}): {' '.join(cmd[:4])} …\n"
                         f"--- last lines of {log} ---\n{tail}")


def _peak_child_rss() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def make_checkpoint(recipe_name: str, out: Path) -> None:
    """Step 1, run in a subprocess: tokenizer + seeded random-init checkpoint into `out`."""
    import torch
    from transformers import GenerationConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from iq36.devmodels.tokenizer import build_hf_tokenizer

    recipe = get_recipe(recipe_name)
    torch.manual_seed(recipe.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_hf_tokenizer(max_length=recipe.config["max_position_embeddings"])
    special = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in ("<|im_end|>", "<|endoftext|>")}
    config = Qwen3_5MoeTextConfig(
        **recipe.config,
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        bos_token_id=None,
    )
    dtype = getattr(torch, recipe.torch_dtype)
    torch.set_default_dtype(dtype)
    model = Qwen3_5MoeForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        **recipe.generation_config,
        eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]],
        pad_token_id=special["<|endoftext|>"],
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _ensure_checkpoint(recipe: Recipe, log: Path) -> Path:
    final = checkpoint_dir(recipe)
    if (final / "config.json").is_file():
        return final
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    _run([sys.executable, "-m", "iq36.devmodels.build", "checkpoint", recipe.name, str(staging)], log)
    staging.rename(final)
    return final


def _export(recipe: Recipe, ckpt: Path, out: Path, log: Path) -> None:
    cli = Path(sys.executable).with_name("optimum-cli")
    cmd = [str(cli), "export", "openvino", "--model", str(ckpt),
           "--task", "text-generation-with-past", "--weight-format", recipe.weight_format,
           *recipe.export_args, str(out)]
    _run(cmd, log)
    # The exporter stamps the checkpoint's absolute path into config files. It names a
    # build-local location and would make two identical builds differ, so it is replaced by
    # the checkpoint's content-keyed name (the only edit made to the exporter's output).
    for name in ("config.json", "generation_config.json", "openvino_config.json"):
        path = out / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("_name_or_path", None)
            quant = data.get("quantization_config")
            if isinstance(quant, dict) and quant.get("tokenizer") == str(ckpt):
                quant["tokenizer"] = ckpt.name
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build(name: str, out: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Build (or reuse) a dev model; return its directory."""
    from worker.identity import runtime_identity

    recipe = get_recipe(name)
    target = (out or default_dir(name)).resolve()
    if (target / manifest.MANIFEST).is_file() and not force:
        return target
    paths.logs_dir().mkdir(parents=True, exist_ok=True)
    log = paths.logs_dir() / f"{target.name}.log"
    log.write_text("")
    record: dict[str, Any] = {"name": name, "model_key": model_key(recipe), "dir": str(target)}
    steps = _Steps(f"building {name}", 3, enabled=progress)
    try:
        steps.start("checkpoint (random init)")
        ckpt = _ensure_checkpoint(recipe, log)
        record["checkpoint_s"] = round(steps.done(), 1)

        steps.start(f"export {recipe.weight_format} IR (optimum-intel)")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        _export(recipe, ckpt, staging, log)
        record["export_s"] = round(steps.done(), 1)

        steps.start("lock (manifest)")
        manifest.write_manifest(staging, manifest.build_manifest(staging, runtime_identity()))
        if force and target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        record["lock_s"] = round(steps.done(), 1)
    finally:
        steps.close()
    record["peak_child_rss_bytes"] = _peak_child_rss()
    record["fingerprint"] = manifest.read_manifest(target)["fingerprint"]
    (paths.logs_dir() / f"{target.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return target


def _main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "checkpoint":
        make_checkpoint(argv[1], Path(argv[2]))
    else:
        raise SystemExit("internal entry point: python -m iq36.devmodels.build checkpoint NAME DIR")


if __name__ == "__main__":
    _main(sys.argv[1:])
