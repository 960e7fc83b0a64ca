"""Trains the demo decision model on CPU and writes it as a Kev checkpoint directory.

    python -m kev.demo.train --out kev/demo_model

A tiny Qwen3.5 backbone (3 Gated DeltaNet layers + 1 gated attention layer, value heads = 2 x key
heads, conv kernel 4) and the pointer head, trained from scratch on `kev.demo.tasks`.

A step packs a few documents, each followed by one row per question the generator asks about it,
rendered by the serving `PromptBuilder` (the rows are exactly what serving sends). One
differentiable pass (`kev.demo.train_ops.SweepTrainOps`) reads each document and continues its
rows from the document's states, as serving's state pass + row pass do, with gradients flowing
from every row into its document. Losses:
- cross-entropy over each question's options, from the head's logits (`DecisionHead.logits` with
  trainable w_q / w_k);
- an evidence loss, weight decaying to 0 over training: the attention layer's <decide> query
  should put its mass on the document tokens that state the answer (the generator knows them; a
  fact that is not mentioned points at `<state>`). Without it the model sits on a long plateau
  (chance accuracy for 600+ steps) before it discovers where to look; with it, retrieval forms
  in ~100 steps and the pointer follows.
After training the head temperature is fitted on separately generated questions (NLL, one
scalar), the checkpoint is written, and `kev.demo.evaluate` scores held-out questions through the
serving path.

Fixed seeds; `torch.set_num_threads(2)` by default. Subnormal floats are flushed: tiny gradients
early in training otherwise make CPU steps an order of magnitude slower.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from kev.bank.layout import StatePools
from kev.model.config import ModelConfig
from kev.demo.tasks import Example, build_tokenizer, generate_documents
from kev.demo.train_ops import SweepTrainOps
from kev.request.head import DecisionHead, save_head
from kev.model.qwen35 import Qwen35Model
from kev.ops import PassMeta
from kev.request.prompts import PromptBuilder

MODEL_ID = "kev-demo-tiny"
HEAD_DIM = 256  # R of Kev heads
TRAIN_SEED, CALIBRATION_SEED = 1, 2  # + 1000 x the training seed; evaluation uses its own seed
LAYER_CODES = {"L": "linear_attention", "A": "full_attention"}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    docs_per_step: int = 8  # each with every question about it (5-6 rows)
    lr: float = 3e-3
    warmup: int = 100
    seed: int = 0
    hidden: int = 128
    layers: str = "LLLA"  # one letter per layer: L = Gated DeltaNet, A = gated attention
    init_std: float = 0.1
    evidence_weight: float = 1.0


def demo_config(vocab_size: int, hidden: int, layers: str) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 32 * 32,
        "num_hidden_layers": len(layers),
        "layer_types": [LAYER_CODES[c] for c in layers],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })  # fmt: skip


def init_model(cfg: ModelConfig, seed: int, std: float) -> Qwen35Model:
    """normal(0, std) projections and embeddings, zero (1 + w) norms, unit gated-norm weights,
    A in [1, 16) and dt in [1e-3, 0.1) log-uniform (long-lived DeltaNet states), conv U(+-1/sqrt(W))."""
    g = torch.Generator().manual_seed(seed)
    model = Qwen35Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(0.1), generator=g))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif name.endswith("conv1d.weight"):
                bound = 1 / math.sqrt(cfg.conv_kernel)
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@dataclass(frozen=True, eq=False)
class TrainBatch:
    """Documents and their question rows in one pass (see kev.demo.train_ops), and where the head reads."""

    tokens: torch.Tensor  # [T]
    meta: PassMeta
    picks: torch.Tensor  # [P]: per question <decide>, then each </opt>
    decide: torch.Tensor  # [Q] indices into the picked rows
    options: torch.Tensor  # [O] indices into the picked rows
    counts: list[int]  # options per question
    gold: torch.Tensor  # [Q] gold option index
    row_decide: torch.Tensor  # [Q] position of <decide> within its row
    evidence: list[list[int]]  # [Q] document positions (counting <state>) that state the answer


def pack(groups: Sequence[Sequence[Example]], builder: PromptBuilder) -> TrainBatch:
    """Each group's document (slot j: read -1, write j) followed by its rows (read j, prefix = its
    length); questions in row order."""
    tokens, cu, read, write, prefix = [], [0], [], [], []
    picks, decide, options, counts, gold, row_decide, evidence = [], [], [], [], [], [], []
    for j, group in enumerate(groups):
        doc, _ = builder.document_tokens(group[0].document)
        tokens += doc
        cu.append(len(tokens))
        read.append(-1), write.append(j), prefix.append(0)
        for ex in group:
            row = builder.row_tokens(ex.question, ex.name)
            base = len(tokens)
            tokens += row.ids
            cu.append(len(tokens))
            read.append(j), write.append(-1), prefix.append(len(doc))
            decide.append(len(picks))
            picks.append(base + row.decide_index)
            options += range(len(picks), len(picks) + len(row.option_end_indices))
            picks += [base + i for i in row.option_end_indices]
            counts.append(len(row.option_end_indices))
            gold.append(ex.gold)
            row_decide.append(row.decide_index)
            evidence.append([1 + t for s, e in ex.evidence for t in range(s, e)] or [0])
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    meta = PassMeta(cu_seqlens=as_long(cu), read_slots=as_long(read), write_slots=as_long(write),
                    prefix_lens=as_long(prefix), block_table=torch.zeros(len(read), 0, dtype=torch.int32))
    return TrainBatch(as_long(tokens), meta, as_long(picks), as_long(decide), as_long(options), counts,
                      as_long(gold), as_long(row_decide), evidence)


def batches(n_steps: int, docs_per_step: int, seed: int, builder: PromptBuilder, pool_steps: int = 16):
    """`n_steps` lists of document groups; documents of similar length share a step (less padding)."""
    rng = random.Random(seed)
    done = 0
    while done < n_steps:
        k = min(pool_steps, n_steps - done)
        groups = generate_documents(k * docs_per_step, seed=rng.randrange(2**31))
        groups.sort(key=lambda g: len(builder.document_tokens(g[0].document)[0]))
        chunks = [groups[i * docs_per_step : (i + 1) * docs_per_step] for i in range(k)]
        rng.shuffle(chunks)
        yield from chunks
        done += k


def empty_pools(cfg: ModelConfig) -> StatePools:
    """Pools the training ops never touch (states stay in the autograd graph)."""
    return StatePools.allocate(cfg, num_slots=1, num_blocks=0, block_size=16, dtype=torch.float32)


def option_logits(model: Qwen35Model, head: DecisionHead, batch: TrainBatch, ops: SweepTrainOps) -> torch.Tensor:
    """[Q, Kmax] head logits, -inf past each question's options."""
    hidden = model(batch.tokens, batch.meta, empty_pools(model.cfg), ops, picks=batch.picks)  # [P, d]
    z = head.logits(hidden[batch.decide], hidden[batch.options], batch.counts)  # [O]
    counts = torch.tensor(batch.counts)
    seg = torch.repeat_interleave(torch.arange(len(batch.counts)), counts)
    col = torch.arange(z.shape[0]) - (torch.cumsum(counts, 0) - counts)[seg]
    return z.new_full((len(batch.counts), int(counts.max())), -math.inf).index_put((seg, col), z)


def evidence_loss(ops: SweepTrainOps, batch: TrainBatch) -> torch.Tensor:
    """-log of the attention mass (mean over heads) each row's <decide> puts on its evidence, in
    the last attention layer (recorded by the ops during the forward)."""
    probs = ops.row_attention[-1]  # [Nr, Hq, Lr, Ld + Lr]
    n, lr = probs.shape[0], probs.shape[2]
    ld = probs.shape[3] - lr
    at_decide = probs[torch.arange(n), :, batch.row_decide, :ld]  # [Nr, Hq, Ld]
    rows = torch.tensor([r for r, ev in enumerate(batch.evidence) for _ in ev])
    cols = torch.tensor([t for ev in batch.evidence for t in ev])
    target = torch.zeros(n, ld).index_put((rows, cols), torch.tensor(1.0))
    mass = (at_decide * target[:, None]).sum(-1).mean(-1)  # [Nr, Hq, Ld] -> [Nr]
    return -(mass + 1e-6).log().mean()


def fit_temperature(logits: torch.Tensor, gold: torch.Tensor, steps: int = 200) -> float:
    """The T minimising the NLL of softmax(logits / T) (calibration on held-out questions)."""
    log_t = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([log_t], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(logits / log_t.exp(), gold).backward()
        opt.step()
    return float(log_t.detach().exp())


def save_checkpoint(directory: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                    head: DecisionHead, tokenizer: Tokenizer, model_id: str = MODEL_ID) -> None:
    """A Kev checkpoint directory (kev.model.checkpoint's format): flat text config, `model.*` weights
    in one fp32 safetensors file, head, tokenizer and kev.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_text_dict(), indent=2) + "\n")
    tensors = {f"model.{k}": v.detach().float().cpu().contiguous() for k, v in weights.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_head(directory / "head.safetensors", head)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "kev.json").write_text(json.dumps({"model_id": model_id}, indent=2) + "\n")


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine down to 5% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(out: str | Path, tc: TrainConfig = TrainConfig(), log_every: int = 50) -> dict:
    torch.manual_seed(tc.seed)
    tokenizer = build_tokenizer()
    builder = PromptBuilder(tokenizer)
    cfg = demo_config(tokenizer.get_vocab_size(), tc.hidden, tc.layers)
    model = init_model(cfg, tc.seed, tc.init_std).train()
    g = torch.Generator().manual_seed(tc.seed + 1)
    d = cfg.hidden_size
    w_q = torch.nn.Parameter(torch.randn(HEAD_DIM, d, generator=g) / math.sqrt(d))
    w_k = torch.nn.Parameter(torch.randn(HEAD_DIM, d, generator=g) / math.sqrt(d))
    params = [*model.parameters(), w_q, w_k]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ops = SweepTrainOps(record_attention=tc.evidence_weight > 0)
    warmup = min(tc.warmup, tc.steps // 10 + 1)
    start = time.perf_counter()
    sums = {"loss": 0.0, "acc": 0.0, "evidence": 0.0}
    questions = 0
    for step, groups in enumerate(batches(tc.steps, tc.docs_per_step, TRAIN_SEED + 1000 * tc.seed, builder)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc.steps, tc.lr, warmup)
        batch = pack(groups, builder)
        ops.row_attention.clear()
        logits = option_logits(model, DecisionHead(w_q, w_k, None, None, 1.0), batch, ops)
        loss = F.cross_entropy(logits, batch.gold)
        total = loss
        if tc.evidence_weight:
            ev = evidence_loss(ops, batch)
            total = loss + tc.evidence_weight * (1 - step / tc.steps) * ev
            sums["evidence"] += ev.item()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        questions += len(batch.counts)
        sums["loss"] += loss.item()
        sums["acc"] += float((logits.argmax(-1) == batch.gold).float().mean())
        if (step + 1) % log_every == 0:
            print(f"step {step + 1:5d}  " + "  ".join(f"{k} {v / log_every:.3f}" for k, v in sums.items())
                  + f"  {time.perf_counter() - start:6.0f} s", flush=True)
            sums = dict.fromkeys(sums, 0.0)
    train_s = time.perf_counter() - start

    model.eval()
    ops.record_attention = False
    head = DecisionHead(w_q.detach().clone(), w_k.detach().clone(), None, None, 1.0)
    with torch.no_grad():
        parts = [pack(gr, builder) for gr in batches(8, 16, CALIBRATION_SEED + 1000 * tc.seed, builder)]
        scored = [(option_logits(model, head, b, ops), b.gold) for b in parts]
    k = max(z.shape[1] for z, _ in scored)
    # A finite floor for the padding: d(-inf / T)/dT would be nan.
    logits = torch.cat([F.pad(z, (0, k - z.shape[1]), value=-math.inf) for z, _ in scored]).clamp(min=-1e4)
    temperature = fit_temperature(logits, torch.cat([gd for _, gd in scored]))
    save_checkpoint(out, cfg, model.state_dict(), DecisionHead(head.w_q, head.w_k, None, None, temperature),
                    tokenizer)
    return {"train_seconds": train_s, "questions": questions, "temperature": temperature, **asdict(tc)}


def main(argv: Sequence[str] | None = None) -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="kev/demo_model", help="checkpoint directory to write")
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-questions", type=int, default=600, help="held-out questions to score (0: skip)")
    args = parser.parse_args(argv)
    tc = TrainConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    print(f"training {tc} on {args.threads} threads", flush=True)
    report = train(args.out, tc)
    print(f"trained {tc.steps} steps ({report['questions']} questions) in {report['train_seconds']:.0f} s; "
          f"head temperature {report['temperature']:.3f}; wrote {args.out}", flush=True)
    if args.eval_questions:
        from kev.demo.evaluate import evaluate, format_report

        print(format_report(evaluate(args.out, args.eval_questions)))


if __name__ == "__main__":
    main()
