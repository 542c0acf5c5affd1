"""The train station's side of the Tinker protocol: run a training model's queued ops, in order, on the
resident `TrainingEngine` (Celery-free; tasks/tinker.py wraps it), through the engine's public API only.

A Tinker model is one more adapter in the engine's LRU cache, keyed by its model id (tk<n>), created
from its LoRA config (`marlaas.adapters.lora_config_from_tinker`: rank, alpha, targets from
train_attn / train_mlp / train_unembed) seeded by its `seed`. forward_backward is
`TrainingEngine.forward_backward` with the named loss of `marlaas.train.tinker_losses` summed over
the data (gradients accumulate in the cached adapter); optim_step is `TrainingEngine.optim_step` with
the request's Adam parameters (lr, betas, eps, decoupled weight decay, optional global grad-norm
clip), then weights + optimizer are persisted (`TinkerStore.put_live`), so any trainer process
continues from the last step. Invariants and limits:
- Ops of one model run in seq_id order, one at a time (the single trainer process).
- Gradients accumulated since the last optim_step live only in the trainer process: a trainer restart
  between forward_backward and optim_step loses them (the next optim_step then applies no update for
  them). The engine's cache never evicts them to make room: the model is pinned from its
  forward_backward to its optim_step (an op that fails evicts it, pinned or not).
- One grant of the trainer lane runs the model's ops up to its next optim_step or GRANT_TOKENS tokens
  of forward passes, whichever comes first (`run_queue(..., max_tokens=GRANT_TOKENS)`).
"""

from __future__ import annotations

import logging

import torch

from marlaas.adapters import lora_config_from_tinker
from marlaas.errors import NotFound, UserError
from marlaas.train.engine import AdamParams, Forward, TrainSample, TrainState
from marlaas.types import AdapterBlob

log = logging.getLogger("marlaas.tinker")


GRANT_TOKENS = 16_384
"""Tokens of forward passes one grant of the trainer lane runs for a Tinker model (then the lane goes
back to the weighted round-robin): about one job step's training work (a plan's max_tokens_per_step
is 65,536 generated tokens per step; a job step trains on its prompts and completions)."""


def op_tokens(kind: str, body: dict) -> int:
    """Tokens an op runs through the model: its datums' for forward / forward_backward, else 0."""
    if kind not in ("forward", "forward_backward"):
        return 0
    return sum(len(d.get("tokens") or ()) for d in body.get("data") or ())


def grant_over(kind: str, tokens: int, until_step: bool, max_tokens: int | None) -> bool:
    """Whether a grant ends after an op of `kind`, `tokens` run so far in it."""
    return (until_step and kind == "optim_step") or (max_tokens is not None and tokens >= max_tokens)


def _leaf_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}


def blob_from_state(meta: dict, weights: bytes) -> AdapterBlob:
    """A training checkpoint's weights as an AdapterBlob (PEFT adapter_config dict + safetensors)."""
    from safetensors.torch import load

    names = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in load(weights)}
    cfg = lora_config_from_tinker(meta, names).to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    return AdapterBlob(config=cfg, weights=weights)


def datum_sample(tokens: list[int], targets: list[int]) -> TrainSample:
    """A Tinker datum as the engine's row: position i of `tokens` predicts `targets[i]`. The engine reads
    a row's T completion positions off the T logits before its last token, so the row is `tokens` plus
    one more (never read) token, with explicit targets."""
    return TrainSample(prompt="", prompt_ids=tokens[:1], completion_ids=[*tokens[1:], targets[-1]],
                       behav_logprobs=[0.0] * len(tokens), advantage=0.0, targets=list(targets))


class TinkerTrainer:
    """Runs Tinker training ops on a `TrainingEngine` (one per train worker process)."""

    def __init__(self, ts, engine):
        self.ts, self.engine = ts, engine

    # ---------------------------------------------------------------- the cached adapter
    def _ensure(self, mid: str, meta: dict, weights: bytes | None = None, opt: bytes | None = None) -> None:
        """Make sure model `mid` is cached: as is, from the given weights (replacing it), from its live
        state in the store, or fresh from its seed."""
        eng = self.engine
        if weights is None and mid in eng.cached():
            return
        if weights is None:
            live = self.ts.live(mid)
            if live is not None:
                weights, opt = live
        cfg = lora_config_from_tinker(meta, _leaf_names(eng.base if eng.model is None else eng.model))
        state = None if weights is None else TrainState(0, AdapterBlob(config={}, weights=weights), opt)
        eng.adapter(mid, cfg, state, seed=int(meta.get("seed") or 0))

    def _weights(self, mid: str) -> tuple[AdapterBlob, bytes]:
        return self.engine.adapter_blob(mid), self.engine.optimizer_bytes(mid)

    # ---------------------------------------------------------------- ops
    def run_queue(self, mid: str, until_step: bool = False, max_tokens: int | None = None) -> int:
        """Run the queued ops of model `mid` in seq order; returns how many ran. With `until_step`, up
        to and including the next optim_step (one trainer step); with `max_tokens`, also stop after the
        op that brings the tokens of the forward passes run here to `max_tokens` or more (`grant_over`):
        one grant of the trainer lane, so a model with many large forward_backwards queued and no
        optim_step yields the lane between them. Gradients accumulated across grants stay: the
        model is pinned in the engine's cache from its forward_backward to its optim_step."""
        n, tokens = 0, 0
        while (rid := self.ts.next_op(mid)) is not None:
            req = self.ts.request(rid)
            if req["status"] != "pending":
                continue
            try:
                meta = self.ts.model(None, mid)
                result = getattr(self, "op_" + req["kind"])(mid, meta, req["body"])
            except (UserError, NotFound, ValueError) as e:
                self.ts.fail(rid, f"{type(e).__name__}: {e}", "user")
            except Exception as e:  # the op fails, not the station: the client sees why
                log.exception("tinker op %s of %s failed", req["kind"], mid)
                self.engine.evict(mid)  # never keep a half-updated adapter
                self.ts.fail(rid, f"{type(e).__name__}: {e}", "server")
            else:
                self.ts.finish(rid, result)
            n += 1
            tokens += op_tokens(req["kind"], req["body"])
            if grant_over(req["kind"], tokens, until_step, max_tokens):
                break
        return n

    def _forward(self, mid: str, meta: dict, body: dict, backward: bool) -> dict:
        from marlaas.train.tinker_losses import loss_fn

        fn = loss_fn(body["loss_fn"])
        config = {k: v for k, v in (body.get("loss_fn_config") or {}).items() if isinstance(v, (int, float))}
        samples, inputs = [], []
        for i, d in enumerate(body["data"]):
            tokens, named = list(d["tokens"]), dict(d["inputs"])
            if "target_tokens" not in named:
                raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
            target = [int(t) for t in torch.tensor(named.pop("target_tokens")).reshape(-1).tolist()]
            if len(target) != len(tokens) or not tokens:
                raise UserError(f"datum {i}: {len(target)} target tokens for {len(tokens)} input tokens")
            samples.append(datum_sample(tokens, target))
            inputs.append(named)
        if not samples:
            return {"outputs": [], "metrics": {"loss:sum": 0.0}}
        self._ensure(mid, meta)
        dev = self.engine.device
        per_datum: list[tuple[float, torch.Tensor]] = []

        def loss(f: Forward):
            total = None
            for lp, j in zip(f.rows(), f.indices()):  # one micro-batch of the datums at a time, in order
                named = inputs[j]
                tensors = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in named.items()}
                value, elem = fn(lp, tensors, config)
                per_datum.append((float(value.detach()), elem.detach()))
                total = value if total is None else total + value
            return total, {}

        res = self.engine.forward_backward(mid, samples, loss, backward=backward, additive=True)
        outputs = []
        for lp, (_, elem) in zip(res.forward.rows(), per_datum):
            out = {"logprobs": ["float32", lp.cpu().tolist()]}
            if body["loss_fn"] == "cross_entropy":
                out["elementwise_loss"] = ["float32", elem.cpu().tolist()]
            outputs.append(out)
        return {"outputs": outputs, "metrics": {"loss:sum": sum(v for v, _ in per_datum)}}

    def op_forward(self, mid: str, meta: dict, body: dict) -> dict:
        return self._forward(mid, meta, body, backward=False)

    def op_forward_backward(self, mid: str, meta: dict, body: dict) -> dict:
        out = self._forward(mid, meta, body, backward=True)
        self.engine.pin(mid)  # its gradients wait for the optim_step, maybe across grants
        return out

    def op_optim_step(self, mid: str, meta: dict, body: dict) -> dict:
        p = body["adam"]
        self._ensure(mid, meta)
        lr, b1, b2 = float(p.get("learning_rate", 1e-4)), float(p.get("beta1", 0.9)), float(p.get("beta2", 0.95))
        eps, wd, clip = float(p.get("eps", 1e-12)), float(p.get("weight_decay", 0.0)), float(p.get("grad_clip_norm", 0))
        if not (lr >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and eps > 0 and wd >= 0):
            raise UserError(f"invalid Adam parameters {p}")
        out = self.engine.optim_step(mid, AdamParams(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, clip=clip))
        self.engine.unpin(mid)
        metrics: dict[str, float] = {}
        if "grad_norm" in out:
            metrics["grad_norm:mean"] = out["grad_norm"]
        blob, opt = self._weights(mid)
        self.ts.put_live(mid, blob.weights, opt)
        self.ts.count_step(mid)
        return {"metrics": metrics}

    def op_save_weights(self, mid: str, meta: dict, body: dict) -> dict:
        self._ensure(mid, meta)
        blob, opt = self._weights(mid)
        ck = self.ts.put_state(mid, body["name"], blob.weights, opt)
        return {"path": f"tinker://{mid}/{ck}", "type": "save_weights"}

    def op_save_weights_for_sampler(self, mid: str, meta: dict, body: dict) -> dict:
        self._ensure(mid, meta)
        blob = self.engine.adapter_blob(mid)
        v = self.ts.put_sampler_weights(mid, blob, body.get("name"))
        if body.get("name") is not None:
            return {"path": f"tinker://{mid}/sampler_weights/{body['name']}", "type": "save_weights_for_sampler"}
        sid = self.ts.create_sampler(meta["tenant"], meta["base"], None, mid, v)
        return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

    def op_load_weights(self, mid: str, meta: dict, body: dict) -> dict:
        from marlaas.store.tinker import parse_path

        src, _, name = parse_path(body["path"])
        weights, opt = self.ts.state(meta["tenant"], src, name)
        self._ensure(mid, meta, weights=weights, opt=opt if body.get("optimizer") else None)
        blob, opt_now = self._weights(mid)
        self.ts.put_live(mid, blob.weights, opt_now)
        return {"path": body["path"], "model_id": mid, "type": "load_weights"}
