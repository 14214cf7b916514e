"""sharding.*, checkpoint.*, loop.*: defects in the trainer's data and expert parallelism (nmoe/sharding.py,
the gradient reduction and norm over ranks; nmoe/train/checkpoint.py, the per-rank keys of expert shards;
nmoe/train/loop.py, the loss every rank logs, the run they log under, the graph a step frees and the norm of
accumulated microbatches)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

LOOP_TEST = ("tests/test_train_loop.py::"
             "test_two_gloo_ranks_train_like_one_rank_on_the_same_global_batch")

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "sharding.expert_grads_all_reduced", "nmoe/sharding.py",
        "        if shard_of(p) is None:\n            all_reduce_sum(p.grad)",
        "        if True:\n            all_reduce_sum(p.grad)",
        "expert-sharded gradients are summed across ranks like replicated ones (each rank adds other "
        "experts' gradients into its own)", "tests/test_sharding.py",
    ),
    sep_mutation(
        "sharding.expert_norm_local", "nmoe/sharding.py",
        "    if all_reduce_sum is not None:\n        all_reduce_sum(own)",
        "    if all_reduce_sum is None:\n        all_reduce_sum(own)",
        "the clip norm counts only this rank's experts, so ranks clip by different norms",
        "tests/test_sharding.py",
    ),
    sep_mutation(
        "checkpoint.expert_keys_shared", "nmoe/train/checkpoint.py",
        '    return {"model": {keys.get(k, k): v for k, v in model.state_dict().items()},',
        '    return {"model": model.state_dict(),',
        "every rank saves its experts under the parameter's own name: DCP keeps one rank's copy and the "
        "others resume with foreign experts", "tests/test_train_checkpoint.py",
    ),
    Mutation(
        "loop.local_loss_logged", "nmoe/train/loop.py",
        "                    _all_reduce_sum(mean_loss)\n",
        "",
        "each rank logs (and checks for NaN) its own half-batch loss, not the global batch's mean",
        tests=(LOOP_TEST,),
    ),
    sep_mutation(
        "loop.previous_graph_kept", "nmoe/train/loop.py",
        "                        loss = loss.detach()\n", "",
        "the eager step's loss keeps its autograd graph into the next step: its AccumulateGrad nodes, made "
        "on the default stream, make that stream wait on the CUDA graph capture (train.cuda_graph fails)",
        "tests/test_train_loop.py",
    ),
    sep_mutation(
        "loop.accum_norm_of_the_sum", "nmoe/train/optim.py",
        "all_reduce_sum) / accum\n", "all_reduce_sum)\n",
        "with gradient accumulation the clip norm is taken of the microbatches' summed gradients, not of "
        "their mean: train.grad_accum times the step's norm, logged, and clipping at that many times too "
        "early", "tests/test_train_loop.py",
    ),
    Mutation(
        "loop.run_id_per_rank", "nmoe/train/loop.py",
        "        dist.broadcast_object_list(shared, src=0)\n",
        "",
        "every rank names the run itself: rank 1's metrics land under a run id no experiment row knows",
        tests=("tests/test_train_cli.py::test_torchrun_two_cpu_ranks_train_one_run",),
    ),
)
