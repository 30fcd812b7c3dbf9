"""A Megatron-Core GPT model saved at tensor parallel 2, loaded at tensor parallel 1.

    torchrun --nproc-per-node 2 examples/megatron_gpt_tp.py save --root /tmp/gpt --tp 2
    torchrun --nproc-per-node 1 examples/megatron_gpt_tp.py load --root /tmp/gpt --tp 1

`save`: Megatron's parallel state at `--tp` (the rest of the ranks data parallel), a small
`GPTModel` (randomly initialised by Megatron, on the CPU), one SGD step on a fixed batch,
then `swc.save({"model": model.sharded_state_dict(), "iteration": 1}, root/ckpt)`: the
state Megatron's training hands `dist_checkpointing`, in Megatron's own format (Megatron's
`dist_checkpointing.load` opens it too). Rank 0 writes the logits of a fixed input,
gathered over the vocabulary, to `root/expected.pt`.

`load`: a freshly (differently) initialised model at another `--tp`, `swc.load` of the
checkpoint into its `sharded_state_dict()` (the parameters are filled in place, each rank
reading only its tensor-parallel slices), then the logits of the same input are compared
with the saved run's. They agree up to float summation order (row-parallel layers add
partial products across the TP ranks): the largest difference is printed with `PASS`.

The vocabulary (64) is a multiple of 8 x TP for TP 1, 2, 4 and 8, so no TP pads it
differently (Megatron's `make_vocab_size_divisible_by`). `--cuda` builds the model on one
GPU per rank with NCCL where CUDA is available; the default is the CPU with gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardwise.checkpoint as swc


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=("save", "load"))
    p.add_argument("--root", required=True, help="a local folder for the checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cuda", action="store_true", help="NCCL and one GPU per rank")
    return p.parse_args()


def cpu_stand_ins() -> None:
    """What Megatron-Core's forward needs on a CPU-only machine (a GPU job needs neither).

    Its local attention allocates a scratch buffer on `torch.cuda.current_device()`, and
    runs its dropout (here p=0) under the CUDA RNG tracker's `fork()`, whose CUDA RNG
    states are seeded by `model_parallel_cuda_manual_seed` on GPUs only."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def build(args: argparse.Namespace, cuda: bool) -> Any:
    """Megatron's parallel groups at `args.tp`, and a GPT model on this rank."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not cuda:
        cpu_stand_ins()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    # One seed for every rank, as Megatron seeds the CPU generator (replicated weights, such
    # as the position embeddings, must agree over TP); another one per TP size, so that the
    # load starts from other values than the save.
    torch.manual_seed(args.seed + args.tp)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp,
        activation_func=F.gelu,
        use_cpu_initialization=not cuda,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
    )
    return model.cuda() if cuda else model


def tokens(args: argparse.Namespace, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A fixed batch of 2 sequences: input ids, positions, and a causal attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=g)
    positions = torch.arange(args.seq).expand(2, -1)
    mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1)  # True: masked out
    return {
        "input_ids": ids.to(device),
        "position_ids": positions.to(device),
        "attention_mask": mask.to(device),
    }


def logits(model: Any, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Logits of the fixed evaluation input, gathered over the vocabulary, on the CPU."""
    model.eval()
    with torch.no_grad():
        out = model(**tokens(args, 0, device), runtime_gather_output=True)
    return out.float().cpu()


def sgd_step(model: Any, args: argparse.Namespace, device: torch.device) -> None:
    """One training step (next-token loss, plain SGD), so the saved weights are trained."""
    model.train()
    batch = tokens(args, 1, device)
    labels = batch["input_ids"].roll(-1, dims=1)
    loss = model(**batch, labels=labels).float().mean()  # per-token losses, vocab-parallel
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
            p.grad = None


def main() -> int:
    args = parse_args()
    warnings.filterwarnings("ignore")  # Megatron warns about Apex / Transformer Engine
    cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)
    path, expected_file = root / "ckpt", root / "expected.pt"
    model = build(args, cuda)
    status = 0

    if args.phase == "save":
        sgd_step(model, args, device)
        want = logits(model, args, device)
        # what Megatron's training checkpoints: the model's sharded state dict, and the
        # common state (here the iteration) that Megatron keeps beside it
        swc.save({"model": model.sharded_state_dict(), "iteration": 1}, path)
        if rank == 0:
            torch.save({"logits": want, "tp": args.tp}, expected_file)
            print(f"saved at TP {args.tp} on {world} ranks: {path}", flush=True)
    else:
        before = logits(model, args, device)
        state = {"model": model.sharded_state_dict()}
        swc.load(state, path)  # fills the parameters in place; the common state merged in
        got = logits(model, args, device)
        if rank == 0:
            expected = torch.load(expected_file)
            want = expected["logits"]
            diff = float((got - want).abs().max())
            ok = got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
            changed = not torch.allclose(before, want, rtol=1e-4, atol=1e-5)
            print(
                f"loaded at TP {args.tp} on {world} ranks (saved at TP {expected['tp']}), "
                f"iteration {state.get('iteration')}",
                flush=True,
            )
            print(f"{'PASS' if changed else 'FAIL'}: the fresh model's logits differed", flush=True)
            print(
                f"{'PASS' if ok else 'FAIL'}: logits {tuple(got.shape)} match "
                f"(max |difference| {diff:.1e})",
                flush=True,
            )
            status = 0 if ok and changed else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
