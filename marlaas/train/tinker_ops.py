"""The train station's side of the Tinker protocol: run a training model's queued ops, in order, on the
resident `TrainingEngine` (Celery-free; tasks/tinker.py wraps it).

A Tinker model is one more adapter in the engine's LRU cache, keyed by its model id (tk<n>), created
from its LoRA config (rank, alpha 32, targets from train_attn / train_mlp / train_unembed) seeded by
its `seed`. forward_backward accumulates gradients in the cached adapter's parameters; optim_step
applies Adam with the request's parameters (lr, betas, eps, decoupled weight decay, optional global
grad-norm clip), clears the gradients and persists weights + optimizer (`TinkerStore.put_live`), so
any trainer process continues from the last step. Invariants and limits:
- Ops of one model run in seq_id order, one at a time (the single trainer process).
- Gradients accumulated since the last optim_step live only in the trainer process: a trainer restart
  or an eviction from the engine's cache between forward_backward and optim_step loses them (the
  next optim_step then applies no update for them).
- This module reaches into the engine's cache helpers (`_install`, `_activate`, `_jobs`): it is the
  engine's second client, kept out of engine.py to leave that file to its owners.
"""

from __future__ import annotations

import logging

import torch

from marlaas.errors import NotFound
from marlaas.types import AdapterBlob

log = logging.getLogger("marlaas.tinker")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


class UserError(ValueError):
    """A request the client got wrong (its future fails with category 'user')."""


def targets(meta: dict, module_names: set[str]) -> list[str]:
    """The LoRA target module names of a model's flags that exist in the base."""
    want: list[str] = []
    for flag, names in (("train_attn", ATTN), ("train_mlp", MLP), ("train_unembed", UNEMBED)):
        if int(meta.get(flag, 1)):
            want += [n for n in names if n in module_names]
    if not want:
        raise UserError("the LoRA config trains no module of this base (train_attn / train_mlp / train_unembed)")
    return want


def peft_config(meta: dict, module_names: set[str]):
    from peft import LoraConfig

    return LoraConfig(r=int(meta["rank"]), lora_alpha=float(meta.get("alpha", 32)), lora_dropout=0.0,
                      target_modules=targets(meta, module_names), bias="none", task_type="CAUSAL_LM")


def _leaf_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}


def blob_from_state(meta: dict, weights: bytes) -> AdapterBlob:
    """A training checkpoint's weights as an AdapterBlob (PEFT adapter_config dict + safetensors)."""
    from safetensors.torch import load

    names = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in load(weights)}
    cfg = peft_config(meta, names).to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    return AdapterBlob(config=cfg, weights=weights)


class TinkerTrainer:
    """Runs Tinker training ops on a `TrainingEngine` (one per train worker process)."""

    def __init__(self, ts, engine):
        self.ts, self.engine = ts, engine

    # ---------------------------------------------------------------- the cached adapter
    def _entry(self, mid: str, meta: dict, weights: bytes | None = None, opt: bytes | None = None,
               fresh: bool = False):
        from safetensors.torch import load

        eng = self.engine
        entry = eng._jobs.get(mid)
        if entry is not None and not fresh and weights is None:
            eng._jobs.move_to_end(mid)
            return entry
        if weights is None and not fresh:
            live = self.ts.live(mid)
            if live is not None:
                weights, opt = live
        cfg = peft_config(meta, _leaf_names(eng.base if eng.model is None else eng.model))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(meta.get("seed") or 0))
            return eng._install(mid, cfg, 0, load(weights) if weights is not None else None, opt, 1e-4)

    def _weights(self, mid: str) -> tuple[AdapterBlob, bytes]:
        return self.engine.adapter_blob(mid), self.engine.optimizer_bytes(mid)

    # ---------------------------------------------------------------- ops
    def run_queue(self, mid: str, until_step: bool = False) -> int:
        """Run the queued ops of model `mid` in seq order (with `until_step`, up to and including the
        next optim_step: one trainer step); returns how many ran."""
        n = 0
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
            if until_step and req["kind"] == "optim_step":
                break
        return n

    def _forward(self, mid: str, meta: dict, body: dict, backward: bool) -> dict:
        from marlaas.train.tinker_losses import loss_fn

        fn = loss_fn(body["loss_fn"])
        config = {k: v for k, v in (body.get("loss_fn_config") or {}).items() if isinstance(v, (int, float))}
        entry = self._entry(mid, meta)
        eng = self.engine
        eng._activate(entry)
        eng.model.train()
        dev = eng.device
        outputs, total = [], 0.0
        for i, d in enumerate(body["data"]):
            tokens = d["tokens"]
            inputs = dict(d["inputs"])
            if "target_tokens" not in inputs:
                raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
            target = torch.tensor(inputs.pop("target_tokens"), dtype=torch.long, device=dev).reshape(-1)
            if target.numel() != len(tokens) or not tokens:
                raise UserError(f"datum {i}: {target.numel()} target tokens for {len(tokens)} input tokens")
            ids = torch.tensor([tokens], dtype=torch.long, device=dev)
            with torch.set_grad_enabled(backward):
                logits = eng.model(input_ids=ids).logits[0].float()
                lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
                tensors = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in inputs.items()}
                loss, elem = fn(lp, tensors, config)
                if backward:
                    loss.backward()
            total += float(loss.detach())
            out = {"logprobs": ["float32", lp.detach().cpu().tolist()]}
            if body["loss_fn"] == "cross_entropy":
                out["elementwise_loss"] = ["float32", elem.detach().cpu().tolist()]
            outputs.append(out)
        return {"outputs": outputs, "metrics": {"loss:sum": total}}

    def op_forward(self, mid: str, meta: dict, body: dict) -> dict:
        return self._forward(mid, meta, body, backward=False)

    def op_forward_backward(self, mid: str, meta: dict, body: dict) -> dict:
        return self._forward(mid, meta, body, backward=True)

    def op_optim_step(self, mid: str, meta: dict, body: dict) -> dict:
        p = body["adam"]
        entry = self._entry(mid, meta)
        lr, b1, b2 = float(p.get("learning_rate", 1e-4)), float(p.get("beta1", 0.9)), float(p.get("beta2", 0.95))
        eps, wd, clip = float(p.get("eps", 1e-12)), float(p.get("weight_decay", 0.0)), float(p.get("grad_clip_norm", 0))
        if not (lr >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and eps > 0 and wd >= 0):
            raise UserError(f"invalid Adam parameters {p}")
        for g in entry.optimizer.param_groups:
            g.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        metrics: dict[str, float] = {}
        if any(q.grad is not None for q in entry.params):
            if clip > 0:
                metrics["grad_norm:mean"] = float(torch.nn.utils.clip_grad_norm_(entry.params, clip))
            entry.optimizer.step()
        entry.optimizer.zero_grad(set_to_none=True)
        blob, opt = self._weights(mid)
        self.ts.put_live(mid, blob.weights, opt)
        self.ts.count_step(mid)
        return {"metrics": metrics}

    def op_save_weights(self, mid: str, meta: dict, body: dict) -> dict:
        self._entry(mid, meta)
        blob, opt = self._weights(mid)
        ck = self.ts.put_state(mid, body["name"], blob.weights, opt)
        return {"path": f"tinker://{mid}/{ck}", "type": "save_weights"}

    def op_save_weights_for_sampler(self, mid: str, meta: dict, body: dict) -> dict:
        self._entry(mid, meta)
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
        self._entry(mid, meta, weights=weights, opt=opt if body.get("optimizer") else None, fresh=True)
        blob, opt_now = self._weights(mid)
        self.ts.put_live(mid, blob.weights, opt_now)
        return {"path": body["path"], "model_id": mid, "type": "load_weights"}
