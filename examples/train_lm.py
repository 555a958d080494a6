"""Train a small character-level Gated DeltaNet language model end to end.

    PYTHONPATH=. python examples/train_lm.py                 # compiled (inductor), CPU or CUDA
    PYTHONPATH=. python examples/train_lm.py --no-compile    # eager
    PYTHONPATH=. python examples/train_lm.py --backend aot_eager --steps 100
    PYTHONPATH=. python examples/train_lm.py --checkpoint          # each block under non-reentrant checkpoint
    PYTHONPATH=. python examples/train_lm.py --cuda-graph          # CUDA: the compiled step replays CUDA graphs
    PYTHONPATH=. python examples/train_lm.py --trace out/trace     # torch.profiler trace of steps 2-4
    PYTHONPATH=. python examples/train_lm.py --cp 2                # context parallel over 2 ranks (eager)

Model: Embedding -> n_layers x [RMSNorm -> cake_ops.GatedDeltaNet -> +, RMSNorm -> SwiGLU
-> +] -> RMSNorm -> LM head. Data: the paragraphs of ``examples/data/fables.txt``, one
document each. Every step packs randomly drawn documents (each truncated to a random
length <= --max-doc-len) into one row of exactly T tokens described by ``cu_seqlens``.
``cu_seqlens`` always has --max-docs + 1 entries (unused slots are empty documents at the
end, i.e. repeated T) so every step has the same shapes and the compiled model never
recompiles. The loss is next-character cross entropy inside each document: the target
that would cross a document boundary is masked out.

--cp N: context parallel (``cake_ops.kcp``). N ranks (spawned processes: gloo on the CPU,
NCCL one GPU a rank; or torchrun's, ``torchrun --nproc-per-node N examples/train_lm.py
--cp N``) draw the same packed row, each takes its rows of it (``KcpContext.shard``), and
every GatedDeltaNet layer runs ``short_conv_kcp`` and ``gdn_kcp`` on them, the rest of the
model per token. The loss is each rank's sum over its targets divided by the row's count,
so the ranks' losses and gradients add up to the one-process ones: the gradients are
all-reduced before the optimizer step, as data parallel does. At step 0 every rank also
runs the model on the whole row and checks that the all-reduced loss and gradients match
it (the script fails otherwise). Eager by default: each step's documents make a new
plan, which a compiled model (``--compile``) recompiles for until Dynamo takes the
plan's sizes as dynamic.

--trace writes a trace that TensorBoard's profiler plugin (torch-tb-profiler) opens, and
prints each cake stage's time per step: the CUDA ops launch every stage's kernels under a
range named after the op and the stage (``cake::gdn_fwd/walk``, ``cake::gdn_bwd/local``,
...; README, "Profiling").

Exits with status 1 if the final smoothed loss is not below the initial one (or is not
finite), so CI can use a short run as an end-to-end check of the ops under training.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import cake_ops
from cake_ops.kcp import build_context_kcp
from cake_ops.testing import accuracy

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fables.txt")
BOS = "\n"  # paragraphs are single lines, so a newline can mark a document's start
IGNORE = -100

# Per-device defaults; every one can be overridden on the command line.
DEFAULTS = {
    "cpu": dict(hidden=128, layers=2, heads=2, v_heads=4, head_dim=32, seq_len=512, max_docs=8,
                max_doc_len=256, steps=300, lr=4e-3, log_every=25),
    "cuda": dict(hidden=512, layers=4, heads=4, v_heads=8, head_dim=128, seq_len=2048, max_docs=32,
                 max_doc_len=512, steps=400, lr=2e-3, log_every=50),
}


# ----------------------------------------------------------------------------- data


class CharData:
    """Character vocabulary plus the documents (paragraphs) as token id lists."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
        paragraphs = [p for p in paragraphs if p]
        self.chars = sorted(set("".join(paragraphs)) | {BOS})
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.docs = [self.encode(BOS + p) for p in paragraphs]
        self.num_chars = sum(len(p) for p in paragraphs)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def pack_batch(data: CharData, rng: random.Random, T: int, max_docs: int, min_doc_len: int, max_doc_len: int):
    """One packed row of exactly T tokens.

    Returns (tokens [T], targets [T] with IGNORE at each document's last token,
    cu_seqlens [max_docs + 1] int32 padded with repeated T, number of real documents).
    Each document is a random paragraph truncated to a random length in
    [min_doc_len, max_doc_len]: half of the time its beginning (with BOS), otherwise a
    window at a random offset. The document that would overflow T is truncated to fit.
    Only when max_docs slots cannot hold T tokens (documents shorter than T / max_docs)
    does the last slot become a padding document whose targets are all masked.
    """
    tokens: list[int] = []
    targets: list[int] = []
    cu = [0]
    n_docs = 0
    while len(tokens) < T:
        room = T - len(tokens)
        if len(cu) == max_docs:
            # Last slot and still room: a padding document that has no loss at all.
            tokens += [0] * room
            targets += [IGNORE] * room
            cu.append(T)
            break
        n_docs += 1
        doc = rng.choice(data.docs)
        n = min(len(doc), rng.randint(min_doc_len, max_doc_len), room)
        start = 0 if rng.random() < 0.5 else rng.randint(0, len(doc) - n)
        piece = doc[start : start + n]
        tokens += piece
        targets += piece[1:] + [IGNORE]  # never predict across the document boundary
        cu.append(len(tokens))
    cu += [T] * (max_docs + 1 - len(cu))  # empty documents keep the shape static
    return (
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(cu, dtype=torch.int32),
        n_docs,
    )


# ----------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden)
        self.mixer = cake_ops.GatedDeltaNet(
            args.hidden, args.heads, args.v_heads, head_k_dim=args.head_dim, head_v_dim=args.head_dim, conv_size=4
        )
        self.norm2 = RMSNorm(args.hidden)
        self.mlp = SwiGLU(args.hidden, args.mlp_hidden)

    def forward(self, x, cu_seqlens, kcp=None):
        x = x + self.mixer(self.norm1(x), cu_seqlens, kcp)
        return x + self.mlp(self.norm2(x))


class GDNLanguageModel(nn.Module):
    def __init__(self, args, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, args.hidden)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, vocab_size, bias=False)
        # Only plain Linear / Embedding weights are re-initialised: the GDN-specific
        # parameters (conv, A_log, dt_bias, norm) keep the layer's own initialisation.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:  # residual-branch outputs scaled down (GPT-2 style)
            for w in (block.mixer.o_proj.weight, block.mlp.down.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * args.layers))
        if args.tie_embeddings:
            self.head.weight = self.embed.weight
        self.checkpoint = args.checkpoint

    def forward(self, idx, cu_seqlens=None, targets=None, kcp=None):
        """idx: [1, T] (packed documents described by cu_seqlens) or [B, T]; with ``kcp``
        [1, T_r], this rank's rows of the packed row. Returns the logits, or with targets
        the mean next-token loss over the unmasked ones (with ``kcp`` their sum: the
        caller divides by the row's count)."""
        x = self.embed(idx)
        for block in self.blocks:
            if self.checkpoint and self.training:
                x = checkpoint(block, x, cu_seqlens, kcp, use_reentrant=False)
            else:
                x = block(x, cu_seqlens, kcp)
        logits = self.head(self.norm(x)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="mean" if kcp is None else "sum")


# ----------------------------------------------------------------------------- training


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def generate(model, data: CharData, prompt: str, n_chars: int, temperature: float, gen: torch.Generator, device, amp):
    """Eager, no state caching: the model reruns on the whole prefix for each character."""
    ids = data.encode(prompt)
    for _ in range(n_chars):
        x = torch.tensor([ids], device=device)
        with amp():
            logits = model(x)[0, -1]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, -1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
    return data.decode(ids)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="training steps (device default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile(model, fullgraph=True) (default: on, but off with --cp, where each step's "
                        "new plan recompiles until Dynamo takes its sizes as dynamic)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend, e.g. inductor or aot_eager")
    p.add_argument("--checkpoint", action="store_true",
                   help="each block under non-reentrant torch.utils.checkpoint (its activations recomputed in backward)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: the compiled forward and backward replay CUDA graphs (torch.compile mode='reduce-overhead')")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a torch.profiler trace of steps 2-4 to DIR (TensorBoard's torch-tb-profiler opens it) "
                        "and print each cake stage's time per step")
    p.add_argument("--time-budget", type=float, default=150.0,
                   help="seconds since start (compile included) after which training stops early; <= 0: none")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (0: torch's default). On an idle 2-core machine 2 threads are "
                        "~1.4x faster for this small model, but 5-10x slower as soon as other processes compete "
                        "for the cores (OpenMP threads spin against each other); 1 keeps the run time predictable")
    p.add_argument("--cp", type=int, default=1, metavar="N",
                   help="context parallel over N ranks (cake_ops.kcp; module docstring)")
    p.add_argument("--cp-layout", default="C", choices=("C", "Z", "D"), help="with --cp: build_context_kcp's layout")
    p.add_argument("--cp-align", type=int, default=1,
                   help="with --cp: build_context_kcp's align. 1 cuts the row at exact token counts, so this "
                        "example's short documents cross ranks; GRID_ALIGN (4096), the library's default, keeps "
                        "deterministic KCP bitwise the single GPU but moves each cut to a 4096-token mark of its "
                        "document, past every document this example draws")
    p.add_argument("--data", default=DATA)
    for name in ("hidden", "layers", "heads", "v_heads", "head_dim", "seq_len", "max_docs", "max_doc_len", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="(device default)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (device default)")
    p.add_argument("--min-doc-len", type=int, default=None, help="shortest truncation (default: ceil(T / max_docs))")
    p.add_argument("--mlp-hidden", type=int, default=None, help="SwiGLU width (default: 3 * hidden)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 8%% of steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--smooth", type=int, default=20, help="steps averaged for the first / last smoothed loss")
    p.add_argument("--gen-chars", type=int, default=120)
    p.add_argument("--prompt", default="The fox")
    args = p.parse_args()
    kind = torch.device(args.device).type
    if args.cp < 1:
        p.error("--cp N needs N >= 1")
    if args.cp > 1 and (args.cuda_graph or args.trace):
        p.error("--cp takes neither --cuda-graph (each step's documents make a new KCP plan) nor --trace")
    if args.compile is None:
        args.compile = args.cp == 1
    for k, v in DEFAULTS["cuda" if kind == "cuda" else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mlp_hidden is None:
        args.mlp_hidden = 3 * args.hidden
    if args.warmup is None:
        args.warmup = max(1, round(0.08 * args.steps))
    if args.min_doc_len is None:
        # max_docs documents of at least this length always fill T: the padding
        # document of pack_batch is then never needed.
        args.min_doc_len = -(-args.seq_len // args.max_docs)
    args.min_doc_len = max(2, min(args.min_doc_len, args.max_doc_len))
    if args.cuda_graph and (kind != "cuda" or not args.compile or args.backend != "inductor"):
        p.error("--cuda-graph needs a CUDA device and torch.compile with the inductor backend")
    if args.trace and args.steps < 5:
        p.error("--trace profiles steps 2-4: give --steps 5 or more")
    return args


TRACE_STEPS = (2, 5)  # the steps [first, last) that --trace records: compiled, warm


def stage_table(prof, steps: int, on_cuda: bool) -> str:
    """Per step: the device time of each cake op and stage range (the CPU time on a CPU,
    where the ops run their PyTorch implementation and launch no kernels)."""
    # The ops and stage ranges; the kernels (also named cake::..., with their signatures)
    # are each counted in their range.
    rows = [e for e in prof.key_averages() if e.key.startswith("cake::") and "(" not in e.key]
    key = (lambda e: e.device_time_total) if on_cuda else (lambda e: e.cpu_time_total)
    lines = [f"{'cake op / stage':40s} {'calls':>6s} {'ms per step':>12s}"]
    for e in sorted(rows, key=key, reverse=True):
        lines.append(f"{e.key:40s} {e.count // steps:6d} {key(e) / 1e3 / steps:12.3f}")
    return "\n".join(lines)


def all_reduce_grads(model) -> None:
    """Sums the parameters' gradients over the ranks (each rank's is the part of its own
    rows), in one collective."""
    params = list(model.parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def train_in_group(args, **rendezvous) -> int:
    """``train`` in a process group of the --cp ranks (NCCL on CUDA, else gloo; torchrun's
    rendezvous from the environment, or the one given), destroyed after."""
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", **rendezvous)
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def rank_entry(rank: int, args, store_path: str) -> None:
    """A spawned rank of --cp N (one GPU a rank on CUDA)."""
    device_id = None
    if args.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    code = train_in_group(args, store=dist.FileStore(store_path, args.cp), rank=rank, world_size=args.cp,
                          device_id=device_id)
    if code:
        sys.exit(code)


def cp_step_matches(model, loss, whole_loss, whole_grads, on_cuda: bool, log) -> bool:
    """--cp's check at step 0: the ranks' summed loss and gradients against the model on
    the whole row in this process (fp32 on the CPU: only the order of operations differs;
    bf16 autocast on CUDA)."""
    tol = 3e-2 if on_cuda else 1e-4
    dloss = abs(loss.item() - whole_loss.item()) / abs(whole_loss.item())
    grads = [accuracy(p.grad, w) for p, w in zip(model.parameters(), whole_grads)]
    worst = max(a.rel_rms for a in grads)
    ok = dloss <= tol and all(a.finite and a.rel_rms <= tol for a in grads)  # (max() would pass a NaN over)
    log(f"step 0 with KCP against one process on the whole row: loss rel. difference {dloss:.1e}, "
        f"worst gradient rel-RMS {worst:.1e} (tolerance {tol:.0e}){'' if ok else ': FAIL'}", flush=True)
    return ok


def main() -> int:
    args = parse_args()
    if args.cp == 1:
        return train(args)
    if "WORLD_SIZE" in os.environ:  # torchrun's ranks
        if args.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        return train_in_group(args)
    from cake_ops.testing import run_spawned

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.cp:
        print(f"--cp {args.cp} on CUDA needs {args.cp} GPUs, this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_spawned(rank_entry, args.cp, (args, os.path.join(tmp, "store")), timeout=3600)
        except Exception as e:  # a rank's failure: its traceback or exit code
            print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    return 0


def train(args) -> int:
    t_start = time.perf_counter()
    cp = args.cp > 1
    if cp and dist.get_world_size() != args.cp:
        raise SystemExit(f"--cp {args.cp} with a process group of {dist.get_world_size()} ranks")
    rank = dist.get_rank() if cp else 0
    log = print if rank == 0 else (lambda *a, **k: None)
    device = torch.device(args.device)
    if cp and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    on_cuda = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_cuda else contextlib.nullcontext

    data = CharData(args.data)
    model = GDNLanguageModel(args, data.vocab_size).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"data: {len(data.docs)} documents, {data.num_chars} characters, vocab {data.vocab_size}")
    log(f"model: {n_params / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers, "
        f"H={args.heads} HV={args.v_heads} head dim {args.head_dim}, SwiGLU {args.mlp_hidden}, "
        f"{'tied' if args.tie_embeddings else 'untied'} head")
    log(f"run: device {device}{' (bf16 autocast)' if on_cuda else ' (fp32)'}, T={args.seq_len} tokens/step, "
        f"cu_seqlens of {args.max_docs + 1} entries, docs truncated to [{args.min_doc_len}, {args.max_doc_len}], "
        f"{args.steps} steps, lr {args.lr} (warmup {args.warmup}, cosine), "
        f"{'torch.compile(fullgraph=True, backend=' + repr(args.backend) + ')' if args.compile else 'eager'}"
        f"{', CUDA graphs' if args.cuda_graph else ''}{', blocks checkpointed' if args.checkpoint else ''}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        f"{f', context parallel over {args.cp} ranks (layout {args.cp_layout}, align {args.cp_align})' if cp else ''}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=on_cuda or None,
    )

    if args.compile:
        # Static shapes: any recompile is a bug. Under --cp each step's plan is new, and
        # Dynamo recompiles until it takes the plan's sizes as dynamic.
        torch._dynamo.config.error_on_recompile = not cp
        step_model = torch.compile(model, fullgraph=True, backend=args.backend,
                                   mode="reduce-overhead" if args.cuda_graph else None)
    else:
        step_model = model
    prof = None
    if args.trace:
        first, last = TRACE_STEPS
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else []),
            schedule=torch.profiler.schedule(wait=first - 1, warmup=1, active=last - first, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.trace),
        )
        prof.start()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)

    losses: list[float] = []
    docs_seen = 0
    first_step_s = None
    ema = None
    t_log = time.perf_counter()
    tokens_since_log = 0
    stopped_early = False
    model.train()
    for step in range(args.steps):
        tokens, targets, cu, n_docs = pack_batch(data, rng, args.seq_len, args.max_docs, args.min_doc_len, args.max_doc_len)
        if cp:  # the same row on every rank: its plan and this rank's rows of it
            kcp = build_context_kcp(cu.tolist(), layout=args.cp_layout, device=device, align=args.cp_align)
            n_targets = int((targets != IGNORE).sum())
        tokens = tokens[None].to(device, non_blocking=True)
        targets = targets[None].to(device, non_blocking=True)
        cu = cu.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        if cp and step == 0:
            with amp():
                whole_loss = model(tokens, cu, targets)
            whole_grads = torch.autograd.grad(whole_loss, list(model.parameters()))
        t0 = time.perf_counter()
        if args.cuda_graph:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
        with amp():
            if cp:
                loss = step_model(kcp.shard(tokens[0])[None], None, kcp.shard(targets[0])[None], kcp) / n_targets
            else:
                loss = step_model(tokens, cu, targets)
        loss.backward()
        if cp:
            all_reduce_grads(model)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            if step == 0 and not cp_step_matches(model, loss, whole_loss, whole_grads, on_cuda, log):
                return 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # syncs
        losses.append(value)
        docs_seen += n_docs
        if prof is not None and step < TRACE_STEPS[1]:
            prof.step()
            if step == TRACE_STEPS[1] - 1:
                prof.stop()
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        if step == 0:
            first_step_s = time.perf_counter() - t0
            log(f"step    0 | loss {value:.4f} | first step {first_step_s:.1f}s"
                f"{' (includes compiling forward + backward)' if args.compile else ''}", flush=True)
            t_log = time.perf_counter()
            tokens_since_log = 0
            continue
        tokens_since_log += args.seq_len
        if not math.isfinite(value):
            print(f"step {step}: non-finite loss {value}", file=sys.stderr)
            return 1
        last = step == args.steps - 1
        over_budget = args.time_budget > 0 and time.perf_counter() - t_start > args.time_budget
        if cp:  # rank 0's clock decides for every rank: they stop at the same step
            flag = torch.tensor([float(over_budget)], device=device)
            dist.broadcast(flag, 0)
            over_budget = bool(flag.item())
        if step % args.log_every == 0 or last or over_budget:
            now = time.perf_counter()
            log(f"step {step:4d} | loss {value:.4f} | ema {ema:.4f} | lr {lr_at(step, args):.2e} | "
                f"{tokens_since_log / (now - t_log):,.0f} tok/s | {now - t_start:5.1f}s", flush=True)
            t_log, tokens_since_log = now, 0
        if over_budget and not last:
            log(f"time budget of {args.time_budget:.0f}s exceeded: stopping after step {step}")
            stopped_early = True
            break

    t_train_end = time.perf_counter()
    k = max(1, min(args.smooth, len(losses) // 2))
    first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
    log(f"\ntrained {len(losses)} steps ({len(losses) * args.seq_len:,} tokens, {docs_seen} documents)"
        f"{' (stopped early)' if stopped_early else ''}; first step {first_step_s:.1f}s, "
        f"total {t_train_end - t_start:.1f}s since start")
    if args.compile:
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        log(f"compiled graphs: {frames}{'' if cp else ' (recompiles would have raised)'}")
    log(f"loss: step 0 {losses[0]:.4f}, first {k} steps mean {first:.4f} -> last {k} steps mean {final:.4f}"
        f" (uniform would be ln(V) = {math.log(data.vocab_size):.4f})")
    if on_cuda:
        log(f"peak memory{' of rank 0' if cp else ''}: {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB allocated "
            f"({'blocks under checkpoint' if args.checkpoint else 'no checkpoint'}"
            f"{', CUDA graphs' if args.cuda_graph else ''})")
    if prof is not None:
        log(f"trace of steps {TRACE_STEPS[0]}-{TRACE_STEPS[1] - 1} in {args.trace} (tensorboard --logdir {args.trace})")
        log(stage_table(prof, TRACE_STEPS[1] - TRACE_STEPS[0], on_cuda))

    if rank == 0:  # the trained parameters are the same on every rank
        model.eval()
        gen = torch.Generator().manual_seed(args.seed)
        prompt = BOS + args.prompt
        t0 = time.perf_counter()
        greedy = generate(model, data, prompt, args.gen_chars, 0.0, gen, device, amp)
        sampled = generate(model, data, prompt, args.gen_chars, 0.8, gen, device, amp)
        log(f"greedy : {greedy[len(BOS):]!r}")
        log(f"sampled: {sampled[len(BOS):]!r}  (temperature 0.8)")
        log(f"generation {time.perf_counter() - t0:.1f}s; total wall {time.perf_counter() - t_start:.1f}s")

    if not (math.isfinite(final) and final < first):
        print(f"FAIL: final smoothed loss {final:.4f} is not below the initial {first:.4f}", file=sys.stderr)
        return 1
    log("OK: loss went down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
