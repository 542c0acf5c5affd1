"""Pretraining the tiny base model on the built-in task families (a recipe that leaves RL room).

The base must leave room for RL: it should know the right behaviour of every family *and* a
plausible wrong one, so greedy accuracy is modest while sampling often finds a right answer. So
pretraining only sees a visible ~60% subset of each family's inputs and labels an example with the
family's deterministic WRONG answer (`Family.wrong`) about 70% of the time, else with the right
one. The share is not uniform: on "strong" inputs (first character of the input in STRONG_CHARS,
about a third) the right answer is the majority, on the others the wrong one. A uniform 30% right
makes a calibrated model answer wrong greedily everywhere (greedy accuracy ~0); this split gives
greedy accuracy ~0.3 with pass@8 well above it, and a behaviour RL can move. Harder families get a
larger share of each batch. Loss is on the completion tokens and EOS only, never on a tool
family's tool-result tokens (`episodes.action_mask`): the right calc label "[47*38]=1786;1786"
teaches calling the tool and copying its result, the wrong one a direct estimate. Evaluation runs
a tool family's episodes with the calculator in-process (`calculator.calculate`, no service needed).

`build_base` writes an ordinary Hugging Face directory plus `marlaas_base.json` (preset, seed,
steps, per-family greedy accuracy and pass@8 on the "eval" split). `ensure_base` builds only when
that file is missing, atomically (build in a temporary sibling directory, then rename).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from marlaas import families
from marlaas.base import tiny
from marlaas.errors import BaseModelError

META_FILE = "marlaas_base.json"


@dataclass(frozen=True)
class Recipe:
    """How a preset is pretrained."""

    model: str  # tiny.PRESETS key
    steps: int
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1  # cosine decay floor, as a share of lr
    # Probability an example is labelled with the RIGHT answer: `p_right_strong` for inputs whose
    # first character is in STRONG_CHARS (about a third of them), `p_right_weak` for the others
    # (overall ~0.3 right, ~0.7 wrong). The base then answers right greedily on about the
    # "strong" share and still samples right answers often on the rest.
    p_right_strong: float = 0.75
    p_right_weak: float = 0.2
    # Relative share of each family in a batch (families not named: 1.0). Harder families get more.
    weights: tuple[tuple[str, float], ...] = ()
    visible_pct: int = 60  # share of each family's inputs pretraining sees
    eval_n: int = 64  # eval-split prompts per family measured after the build
    eval_samples: int = 8  # samples per prompt for pass@k


_WEIGHTS = (("reverse", 2.0), ("add", 1.25), ("code", 0.75), ("max", 0.75), ("min", 0.75))
# The default model must learn to add (carry included) well enough that RL finds right sums often
# (with add at 1.25 its greedy accuracy was 0.14 and RL did not move it in 50 steps), and to copy a
# tool result (calc) at the same time: both get more of each batch, and training runs longer.
_DEFAULT_WEIGHTS = (("reverse", 2.0), ("add", 4.0), ("calc", 2.0), ("code", 0.75), ("max", 0.75), ("min", 0.75))

RECIPES: dict[str, Recipe] = {
    # ~1M parameters; ~6 min on 2 idle cores; greedy ~0.25-0.45 and pass@8 >= 0.59 per family.
    "default": Recipe(model="default", steps=2000, weights=_DEFAULT_WEIGHTS),
    # ~0.1M parameters, ~15 s: well-formed short answers ending in EOS, low accuracy. For tests.
    "test": Recipe(model="test", steps=250, batch=48, lr=8e-3, warmup=20, weights=_WEIGHTS, eval_n=16),
}


STRONG_CHARS = frozenset("147")  # a third of the digits: every family's input starts with a digit


def strong(fam: families.Family, x: tuple) -> bool:
    """Whether pretraining labels this input mostly right (see Recipe)."""
    return fam.prompt(x).split(":", 1)[1][:1] in STRONG_CHARS


def _visible(prompt: str, pct: int) -> bool:
    return families.bucket(prompt, "pretrain-visible") < pct


def _example(fam: families.Family, rng: random.Random, r: Recipe) -> tuple[str, str, bool]:
    """One (prompt, completion, tool episode?) pretraining example of `fam` from its visible inputs."""
    while True:
        x = fam.sample(rng)
        p = fam.prompt(x)
        if _visible(p, r.visible_pct):
            break
    right = rng.random() < (r.p_right_strong if strong(fam, x) else r.p_right_weak)
    return p, (fam.correct_label(x) if right else fam.wrong(x)), fam.tool is not None


class _Encoder:
    def __init__(self, tokenizer):
        self.vocab = tokenizer.get_vocab()
        self.unk = tokenizer.unk_token_id
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id

    def ids(self, text: str) -> list[int]:
        return [self.vocab.get(c, self.unk) for c in text]


def _batch(examples, enc: _Encoder):
    """Left-padded input_ids, attention_mask, position_ids and labels (-100 except completion+EOS,
    and except a tool episode's tool-result tokens)."""
    import torch

    from marlaas.tools.episodes import action_mask

    seqs, labs = [], []
    for p, c, tool in examples:
        pi, ci = enc.ids(p), enc.ids(c) + [enc.eos]
        seqs.append(pi + ci)
        keep = action_mask(c) + [1] if tool else [1] * len(ci)
        labs.append([-100] * len(pi) + [t if k else -100 for t, k in zip(ci, keep)])
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), enc.pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labs)):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
        labels[i, width - len(s) :] = torch.tensor(lab)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, labels


def _batch_families(r: Recipe) -> list[families.Family]:
    """The family of each row of a batch: fixed counts proportional to the recipe's weights."""
    names = sorted(families.FAMILIES)
    w = dict(r.weights)
    ws = [w.get(n, 1.0) for n in names]
    exact = [r.batch * x / sum(ws) for x in ws]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(names)), key=lambda i: counts[i] - exact[i])[: r.batch - sum(counts)]:
        counts[i] += 1
    return [families.FAMILIES[n] for n, c in zip(names, counts) for _ in range(c)]


def _lr_at(step: int, r: Recipe, total: int) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, total - r.warmup)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, tokenizer, r: Recipe, seed: int, steps: int, progress: bool = True) -> list[float]:
    """Pretrain `model` in place; returns the loss per step."""
    import torch
    from tqdm.auto import tqdm

    enc = _Encoder(tokenizer)
    slots = _batch_families(r)
    rng = random.Random(f"marlaas-pretrain:{seed}")
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="pretrain", disable=not progress, mininterval=1.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, r, steps)
        exs = [_example(f, rng, r) for f in slots]
        ids, mask, pos, labels = _batch(exs, enc)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        if progress and step % 25 == 0:
            bar.set_postfix(loss=f"{sum(losses[-25:]) / len(losses[-25:]):.3f}")
    model.eval()
    return losses


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int = 1,
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = families.MAX_ANSWER_TOKENS,
    batch_size: int = 512,
    stop_ids: tuple[int, ...] = (),
):
    """Completions of each prompt, `n` per prompt: (texts, finished), both [prompt][sample].

    Texts drop special tokens; `finished` says the completion ended with EOS within the budget.
    Sampling is plain temperature 1.0 with top_k=0 and top_p=1.0 set explicitly (transformers'
    generate otherwise applies its default top_k=50).
    """
    import torch

    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(n)]
    texts: list[str] = []
    done: list[bool] = []
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=[eos, *stop_ids] if stop_ids else eos,
                **kw,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
            done += (new == eos).any(dim=1).tolist()
    split = lambda xs: [xs[j * n : (j + 1) * n] for j in range(len(prompts))]  # noqa: E731
    return split(texts), split(done)


def generate_episodes(model, tokenizer, prompts: list[str], *, n: int = 1, greedy: bool = True, seed: int = 0):
    """`generate` for a tool family: each completion is a whole episode (model turns stop at a tool
    call, the calculator runs in-process, at most `episodes.MAX_TURNS` turns). Same return shape."""
    from marlaas.tools import calculator, episodes

    stop = tuple(tokenizer.convert_tokens_to_ids(list(episodes.STOP)))
    texts, done = generate(model, tokenizer, prompts, n=n, greedy=greedy, seed=seed, stop_ids=stop)
    eps = [[episodes.start({"ids": [], "logprobs": [], "text": t}, f) for t, f in zip(ts, fs)]
           for ts, fs in zip(texts, done)]
    finished = [list(fs) for fs in done]
    for turn in range(episodes.MAX_TURNS - 1):
        todo = [(i, j, e) for i, row in enumerate(eps) for j, ep in enumerate(row)
                if (e := episodes.pending_call(ep)) is not None]
        if not todo:
            break
        ctx = []
        for i, j, e in todo:
            try:
                value = calculator.calculate(e)
            except ValueError:
                value = None
            ep = episodes.with_tool_result(eps[i][j], value)
            eps[i][j] = ep = episodes.append_pending(ep, [])
            ctx.append(episodes.context(prompts[i], ep))
        more, more_done = generate(model, tokenizer, ctx, n=1, greedy=greedy, seed=seed + 1 + turn, stop_ids=stop)
        for (i, j, _), t, f in zip(todo, more, more_done):
            eps[i][j] = episodes.add_turn(eps[i][j], [], [], t[0], f[0])
            finished[i][j] = f[0]
    return [[ep["text"] for ep in row] for row in eps], finished


def evaluate(model, tokenizer, eval_n: int = 64, samples: int = 8, seed: int = 0) -> dict:
    """Per family, on `eval_n` prompts of the "eval" split: greedy accuracy, pass@`samples` at
    temperature 1.0, and the share of greedy completions that ended with EOS (`eos_rate`); for a
    tool family also the share of greedy episodes that called the tool (`tool_call_rate`)."""
    from marlaas.tools.episodes import CALL_OPEN

    names = sorted(families.FAMILIES)
    prompts = {nm: [r["prompt"] for r in families.rows(nm, "eval", eval_n, seed=seed)] for nm in names}
    outs = {}
    for tool in (False, True):  # plain families in one batch, tool families' episodes in another
        part = [nm for nm in names if (families.FAMILIES[nm].tool is not None) == tool]
        allp = [p for nm in part for p in prompts[nm]]
        gen = generate_episodes if tool else generate
        greedy, g_done = gen(model, tokenizer, allp, n=1, greedy=True)
        sampled, _ = gen(model, tokenizer, allp, n=samples, greedy=False, seed=seed + 1)
        k = 0
        for nm in part:
            m = len(prompts[nm])
            outs[nm] = (greedy[k:k + m], g_done[k:k + m], sampled[k:k + m])
            k += m
    res: dict[str, dict] = {}
    for nm in names:
        greedy, g_done, sampled = outs[nm]
        g_ok = s_ok = fin = calls = 0
        for k, p in enumerate(prompts[nm]):
            g_ok += families.correct(nm, p, greedy[k][0])
            s_ok += any(families.correct(nm, p, c) for c in sampled[k])
            fin += g_done[k][0]
            calls += CALL_OPEN in greedy[k][0]
        m = len(prompts[nm])
        res[nm] = {
            "greedy_acc": round(g_ok / m, 4),
            f"pass_at_{samples}": round(s_ok / m, 4),
            "eos_rate": round(fin / m, 4),
        }
        if families.FAMILIES[nm].tool is not None:
            res[nm]["tool_call_rate"] = round(calls / m, 4)
    return res


def build_base(
    out_dir,
    preset: str = "default",
    seed: int = 0,
    steps: int | None = None,
    progress: bool = True,
    threads: int = 2,
    recipe: Recipe | None = None,
) -> Path:
    """Initialise, pretrain, evaluate and save a base model into `out_dir`; returns the path.

    Deterministic for (preset, seed, steps). `threads` is the torch thread budget for training
    (evaluation generates with one thread, faster at this size).
    """
    import torch

    r = recipe or RECIPES[preset]
    if steps is not None:
        r = replace(r, steps=steps)
    out_dir = Path(out_dir)
    prev_threads = torch.get_num_threads()
    t0 = time.monotonic()
    try:
        torch.set_num_threads(max(1, threads))
        model, tokenizer = tiny.init_model(r.model, seed=seed)
        losses = train(model, tokenizer, r, seed, r.steps, progress=progress)
        t_train = time.monotonic() - t0
        torch.set_num_threads(1)
        fam_metrics = evaluate(model, tokenizer, eval_n=r.eval_n, samples=r.eval_samples, seed=seed)
    finally:
        torch.set_num_threads(prev_threads)
    tiny.save(model, tokenizer, out_dir)
    meta = {
        "preset": preset,
        "seed": seed,
        "steps": r.steps,
        "model_preset": r.model,
        "recipe": asdict(r),
        "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "train_seconds": round(t_train, 1),
        "build_seconds": round(time.monotonic() - t0, 1),
        "eval": {
            "split": "eval",
            "prompts_per_family": r.eval_n,
            "samples": r.eval_samples,
            "temperature": 1.0,
            "max_new_tokens": families.MAX_ANSWER_TOKENS,
        },
        "families": fam_metrics,
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def ensure_base(path, preset: str = "default", seed: int = 0, progress: bool = True, threads: int = 2) -> Path:
    """The base model at `path`, built there first if `path/marlaas_base.json` is missing or the model
    there is out of date (another preset or seed, or pretrained on another set of task families, e.g.
    built before a family was added: it would not know the new task).

    The build goes into a temporary sibling directory that is renamed into place, so a crash
    never leaves a half-written model at `path`.
    """
    path = Path(path)
    if is_current(path, preset, seed):
        return path
    if path.is_dir() and any(path.iterdir()) and not (path / META_FILE).is_file():
        # Builds are renamed into place whole, so a directory without the marker is not ours: a user's
        # model directory is never written, moved or deleted.
        raise BaseModelError(
            f"{path} holds files that marlaas did not build; it never overwrites such a directory: build "
            "into an empty --out, or use it as the base (MARLAAS_BASE) if it is a causal LM")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        build_base(tmp, preset=preset, seed=seed, progress=progress, threads=threads)
        if is_current(path, preset, seed):  # someone else finished first
            return path
        if path.is_dir() and (path / META_FILE).is_file():  # our own older build (another preset or recipe)
            shutil.rmtree(path)
        elif path.is_dir():  # empty (checked above): os.replace needs it gone
            path.rmdir()
        try:
            os.replace(tmp, path)
        except OSError:
            if not (path / META_FILE).is_file():  # lost a race to a build that finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def prepare_base(settings, progress: bool = True, threads: int = 2) -> Path:
    """The deployment's base, ready to load. A base the user names (MARLAAS_BASE, anywhere but
    `$MARLAAS_HOME/base`) is read-only to marlaas: it is checked (one clear error when it is not a
    loadable causal LM) and never written; the tiny base is built only at marlaas's own location."""
    from marlaas.base.importer import check_base_dir

    own = settings.home / "base"
    if settings.base is not None and Path(settings.base).resolve() != own.resolve():
        check_base_dir(settings.base)
        return Path(settings.base)
    return ensure_base(own, preset=settings.base_preset, seed=0, progress=progress, threads=threads)


def is_current(path, preset: str = "default", seed: int = 0) -> bool:
    """True when `path` holds a finished base of this preset and seed, pretrained with today's recipe
    (a base built without a recorded recipe counts as current when its family set is today's)."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError):
        return False
    if preset not in RECIPES:
        return False
    if "recipe" in meta and meta["recipe"] != json.loads(json.dumps(asdict(RECIPES[preset]))):
        return False
    return (meta.get("preset") == preset and meta.get("seed") == seed
            and sorted(meta.get("families", {})) == sorted(families.FAMILIES))


def read_meta(path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build (pretrain) the marlaas base model.")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="default", choices=sorted(RECIPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory has a base")
    a = ap.parse_args(argv)
    if a.force:
        build_base(a.out_dir, a.preset, a.seed, a.steps, progress=True, threads=a.threads)
    elif a.steps is not None:
        build_base(a.out_dir, a.preset, a.seed, a.steps, progress=True, threads=a.threads)
    else:
        ensure_base(a.out_dir, a.preset, a.seed, progress=True, threads=a.threads)
    print(json.dumps(read_meta(a.out_dir), indent=2))


if __name__ == "__main__":
    main()
