"""One PrecisionPlan per model: it projects exactly the flags the build set before it existed (--first-last-layers-bf16,
the output head); a schedule's switch through it reaches the callbacks and the layer's GEMM; the saturation guard's
switch goes through it and DDP / the optimizer learn of it from the plan, not from the layer; widest_bits reads the
widest format on a ladder (a fake 4-bit recipe); copies of a model get a plan of their own without followers."""
import copy
import pickle
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from optim_testing import build, make_ddp, tiny_config, train_step
from megafp8.fp8 import (CONFIG, GUARD, SCHEDULE, Fp8GemmModule, Fp8Linear, Fp8Recipe, Quantizer, ScalingRule,
                         layer_recipes, plan_of, precision_plan, registered_scaling, scaling_names)
from megafp8.fp8.telemetry import Fp8TensorStats
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import Pipeline
from megafp8.training.train import saturation_guard
from megafp8_kernels.formats import PER_TENSOR

TARGET = "layers.1.mlp.linear_fc1"


def _flags(model):
    return {n: (m.recipe, m.force_high_precision, m.guard_high_precision) for n, m in model.named_modules()
            if isinstance(m, Fp8GemmModule)}


def test_the_plan_projects_the_build_flags_of_the_precision_map_and_the_output_head():
    ps = ParallelState().init_process_groups()
    recipe = Fp8Recipe.tensorwise()
    model = build(tiny_config(num_layers=4), ps, fp8_recipe=recipe, first_last_layers_bf16=1)
    plan = model.precision_plan
    per_block = layer_recipes(4, recipe, 1)
    for name, (own, forced, guarded) in _flags(model).items():
        if name == "output_layer":
            want = (None, True, False)  # the logits GEMM: high precision, by config
        else:
            block = per_block[int(name.split(".")[1])]
            want = (block, block is None, False)
        assert (own, forced, guarded) == want, name
        assert plan_of(dict(model.named_modules())[name]) is plan
        assert plan.recipe_of(name) == (None if forced else own) and plan.reason_of(name) == CONFIG
    assert plan.ladder("layers.1.mlp.linear_fc1") == (recipe, None) and plan.ladder("layers.0.mlp.linear_fc1") == (None,)


def test_a_schedule_switch_at_iteration_k_fires_the_callbacks_and_the_layer_computes_with_the_new_recipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Fp8Linear(64, 64, recipe=Fp8Recipe.tensorwise()),
                                Fp8Linear(64, 64, recipe=Fp8Recipe.tensorwise()))
    plan = precision_plan(model)
    seen = []
    plan.on_change(seen.append)
    x = torch.randn(16, 64)
    rowwise = Fp8Recipe.rowwise()
    for iteration in range(4):
        if iteration == 2:  # the schedule's switch
            plan.set_recipe(["1"], rowwise)
        model(x)
    assert [[(c.name, c.old, c.new, c.reason) for c in changes] for changes in seen] == \
        [[("1", Fp8Recipe.tensorwise(), rowwise, SCHEDULE)]]
    assert model[1].recipe == rowwise and plan.recipe_of("1") == rowwise and plan.ladder("1") == (rowwise, None)
    reference = Fp8Linear(64, 64, recipe=rowwise)
    reference.load_state_dict(model[1].state_dict())
    assert torch.equal(model[1](x), reference(x))
    plan.set_recipe("1", None)  # a schedule may also move a layer to high precision
    assert model[1].force_high_precision and not model[1].guard_high_precision
    assert torch.equal(model[1](x), F.linear(x, model[1].weight, model[1].bias))
    assert len(seen) == 2 and seen[1][0].new is None


def _force_switch(model, guard):
    """The guard's own decision (as tests/test_guard_param_gather.py): TARGET saturates 50% for `patience` checks."""
    target = dict(model.named_modules())[TARGET]
    for _ in range(guard.patience):
        target.fp8_telemetry = {"input": Fp8TensorStats(torch.ones(()), torch.ones(()), torch.tensor([8, 0]), 16)}
        guard.check(model)
    return target


def _gathered_after_one_step():
    """A ZeRO run with --fp8-param-gather, one step in."""
    ps = ParallelState().init_process_groups()
    cfg = tiny_config()
    model = build(cfg, ps, fp8_recipe=Fp8Recipe.tensorwise())
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=True)
    opt = DistributedOptimizer(ddp)
    train_step(ddp, opt, cfg, 0, 1e-3)
    return ps, cfg, model, ddp, opt


def test_the_guard_demotes_through_the_plan_and_ddp_and_the_optimizer_follow_without_polling():
    ps, cfg, model, ddp, opt = _gathered_after_one_step()
    seen = []
    model.precision_plan.on_change(seen.append)
    target = _force_switch(model, saturation_guard(ps))
    assert [(c.name, c.new, c.reason) for changes in seen for c in changes] == [(TARGET, None, GUARD)]
    assert target.guard_high_precision and model.precision_plan.reason_of(TARGET) == GUARD
    assert list(ddp.demoted_fp8_params) == [target.weight] and target.weight in ddp.fp8_params
    assert target in opt._precision_follower._armed  # one pre-hook, on the switched layer only
    # DDP takes the switch from the plan's record, not from the layer's flags: hide them until the next forward.
    target.guard_high_precision = False
    switched = ddp.take_guard_switches()
    target.guard_high_precision = True
    assert [sw.param for sw in switched] == [target.weight] and target.weight not in ddp.fp8_params
    assert not ddp.demoted_fp8_params
    result, loss = train_step(ddp, opt, cfg, 1, 1e-3)
    assert not result.skipped and torch.isfinite(torch.tensor(loss))
    assert not opt._precision_follower._armed and target.weight in ddp.switched_weights


def test_the_first_forward_after_a_guard_switch_fetches_the_high_precision_weight():
    ps, cfg, model, ddp, opt = _gathered_after_one_step()
    target = _force_switch(model, saturation_guard(ps))
    master = dict((n, v) for n, (_p, _s, v) in opt.owned_master_weights().items())[f"{TARGET}.weight"]
    target(torch.randn(4, cfg.hidden_size))  # the armed pre-hook runs before this forward
    assert torch.equal(target.weight.detach().reshape(-1).float(), master)


def test_a_schedule_moving_a_gathered_weight_to_another_recipe_republishes_it():
    ps, cfg, model, ddp, opt = _gathered_after_one_step()
    rowwise = Fp8Recipe.rowwise()
    model.precision_plan.set_recipe(TARGET, rowwise)
    target = dict(model.named_modules())[TARGET]
    assert ddp.fp8_params[target.weight].recipe == rowwise and opt._fp8_publication is None
    result, loss = train_step(ddp, opt, cfg, 1, 1e-3)
    assert not result.skipped and torch.isfinite(torch.tensor(loss))
    injected = target._injected_weight
    assert injected is not None and injected.layout == rowwise.quantizer("weight").layout


@dataclass(frozen=True)
class _Fake4BitQuantizer(Quantizer):
    def __post_init__(self):
        object.__setattr__(self, "format", replace(self.format, bits=4, name="fake_fp4"))


def test_widest_bits_reads_the_widest_format_on_the_ladder_and_demote_walks_it():
    with registered_scaling("plan_fake_fp4", ScalingRule(lambda role, gemm: PER_TENSOR, quantizer=_Fake4BitQuantizer)):
        _widest_bits_and_demote()
    assert "plan_fake_fp4" not in scaling_names()  # nothing leaks into other tests (--fp8-recipe's choices)


def _widest_bits_and_demote():
    fp4, fp8 = Fp8Recipe(scaling="plan_fake_fp4"), Fp8Recipe.tensorwise()
    model = torch.nn.Sequential(Fp8Linear(32, 32, recipe=fp8))
    plan = precision_plan(model)
    assert plan.widest_bits("0") == 8
    plan.set_recipe("0", fp4, CONFIG, ladder=(fp4, None))
    assert plan.widest_bits("0") == 4
    plan.set_recipe("0", fp4, CONFIG, ladder=(fp4, fp8, None))
    assert plan.widest_bits("0") == 8 and plan.widest_bits("0", lambda r: 2) == 2
    seen = []
    plan.on_change(seen.append)
    plan.demote("0")
    assert model[0].recipe == fp8 and not model[0].runs_high_precision
    plan.demote("0")
    assert model[0].guard_high_precision and plan.recipe_of("0") is None
    assert [(c.old, c.new) for changes in seen for c in changes] == [(fp4, fp8), (fp8, None)]
    assert plan.demote("0") == []  # the bottom: no change


def test_the_pipeline_scaling_manager_follows_the_plan():
    ps = ParallelState().init_process_groups()
    pipeline = Pipeline(tiny_config(), ps, micro_batch_size=2, num_microbatches=1, fp8_recipe=Fp8Recipe.tensorwise(),
                        device="cpu")
    assert pipeline.fp8_manager is None
    plan = pipeline.chunks[0].precision_plan
    plan.set_recipe(TARGET, Fp8Recipe.tensorwise().replace(scaling="rowwise"))
    assert pipeline.fp8_manager is None  # no layer keeps state
    plan.set_recipe(TARGET, Fp8Recipe.delayed())
    manager = pipeline.fp8_manager
    assert manager is not None
    plan.set_recipe(TARGET, Fp8Recipe.tensorwise())
    assert pipeline.fp8_manager is manager  # kept


def test_copies_of_a_model_get_their_own_plan_without_followers():
    ps = ParallelState().init_process_groups()
    model = build(tiny_config(), ps, fp8_recipe=Fp8Recipe.tensorwise())
    model.precision_plan.on_change(lambda changes: None)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        layer = dict(copied.named_modules())[TARGET]
        assert plan_of(layer) is copied.precision_plan and copied.precision_plan is not model.precision_plan
        assert copied.precision_plan._callbacks == []
        assert _flags(copied) == _flags(model)
        copied.precision_plan.demote(TARGET)
        assert layer.guard_high_precision and not dict(model.named_modules())[TARGET].guard_high_precision
