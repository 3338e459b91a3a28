"""megatron-ext inside a megatron-core training loop of your own (no driver, no Megatron-LM).

What it shows:
    The five calls a megatron-core script adds, in the order it builds things
    (docs/architecture.md, "Embedding megatron-ext in your own training script"):
    ``ExtRuntime.create`` once the parallel state exists, ``transform_model`` on the unwrapped
    model, ``install`` once DDP and the optimizer exist, ``begin_step`` / ``end_step`` around
    each iteration (``forward_backward_kwargs`` into the schedule), ``finish`` at the end.
    Everything else is plain megatron-core, in the style of its own simple training-loop
    example: ``GPTModel`` with the local layer spec, megatron-core's DDP, its optimizer and
    pipeline schedules. The batches are synthetic (the point is the wiring).

Run (megatron-ext's flags go on the same command line)::

    torchrun --nproc-per-node 2 examples/embed_megatron_core.py --grad-compression separate
    torchrun --nproc-per-node 2 examples/embed_megatron_core.py --cpu \\
        --grass-method topr --grass-rank 16
    torchrun --nproc-per-node 2 examples/embed_megatron_core.py --cpu \\
        --pipeline-model-parallel-size 2 --subspace-method protocol

``--cpu`` runs megatron-core on CPU with gloo (megatron_ext.megatron.cpu). Every rank prints
``rank R step N | loss L | dp-grad sent S of D dense`` (the loss on the last pipeline stage) and
ends with a ``SUMMARY`` JSON line: its losses, bytes sent and dense, and a sum of its weights
(equal across data-parallel replicas).
"""

import argparse
import json
import os
from functools import partial

import torch

from megatron_ext.config import add_args, ext_config_from_args
from megatron_ext.megatron.runtime import ExtRuntime, parallel_layout

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 512, 32, 2, 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="megatron-core on CPU with gloo")
    parser.add_argument("--train-iters", type=int, default=8)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    add_args(parser)  # megatron-ext's flags (--grad-compression, ...)
    return parser.parse_args(argv)


def initialize(args):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if args.cpu:
        from megatron_ext.megatron.cpu import enable_cpu_execution

        enable_cpu_execution(force=True)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("gloo" if args.cpu else "nccl")
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size
    )
    model_parallel_cuda_manual_seed(args.seed)


def build_model(args):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2 * args.pipeline_model_parallel_size,
        hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def batches(args):
    """Counting sequences from random starts (``t, t+1, ...`` modulo the vocabulary: a pattern
    the model learns within a few steps), the same on every pipeline stage of a DP rank."""
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(args.seed + parallel_state.get_data_parallel_rank())
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    while True:
        starts = torch.randint(VOCAB, (MICRO_BATCH, 1), generator=generator)
        tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
        yield {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(MICRO_BATCH, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
            "attention_mask": mask,
        }


def forward_step(data_iterator, model):
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        # A copy: the schedule divides the returned loss in place by the microbatch count.
        return loss, {"lm loss": loss.detach().clone()}

    return output, partial(loss_func, batch["loss_mask"])


def main(argv=None):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = parse_args(argv)
    initialize(args)
    ext_cfg = ext_config_from_args(args)

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    runtime = ExtRuntime.create(ext_cfg, parallel_layout(ddp_config))  # validates the flags
    model = build_model(args)
    runtime.transform_model([model])  # before DDP allocates the gradient buffers
    if not args.cpu:
        model.cuda()
    model = DistributedDataParallel(model.config, ddp_config, model)
    model.broadcast_params()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), [model])
    model.config.finalize_model_grads_func = finalize_model_grads
    runtime.install([model], optimizer, model_config=model.config)

    data = batches(args)
    forward_backward = get_forward_backward_func()
    totals = {"sent": 0, "dense_sent": 0}
    losses = []
    for step in range(args.train_iters):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        runtime.begin_step(step)
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
            **runtime.forward_backward_kwargs(),
        )
        update_successful, _, _ = optimizer.step()
        traffic = runtime.end_step(update_successful)  # commits the step's method state
        for category in traffic.values():
            totals["sent"] += category.sent
            totals["dense_sent"] += category.dense_sent
        loss = sum(float(r["lm loss"]) for r in reports) / len(reports) if reports else None
        losses.append(loss)
        grad = traffic.get("dp-grad")
        print(
            f"rank {torch.distributed.get_rank()} step {step} | loss "
            f"{'-' if loss is None else f'{loss:.4f}'} | dp-grad sent "
            f"{grad.sent if grad else 0} of {grad.dense_sent if grad else 0} dense",
            flush=True,
        )
    runtime.finish()
    summary = {
        "rank": torch.distributed.get_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": losses,
        # Data-parallel replicas must end with the same weights: compare this across them.
        "weights_sum": sum(float(p.detach().double().sum()) for p in model.parameters()),
        **totals,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
