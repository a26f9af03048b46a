"""``trainer.activation_checkpointing``: the same weights and BatchNorm buffers as without it, on 1 process, on 2
DDP ranks, on model_parallel's and a pipeline's stages; less memory; a model without a chain of blocks refused in
one line."""

from __future__ import annotations

import pytest
import torch

from gputrain.config import load_config
from gputrain.data.cifar10 import make_cifar10
from multiproc import run_ranks


def _fit(out: str, root: str, strategy: str, devices: int, checkpointed: bool,
         extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    from gputrain.engine.state import seed_everything
    from gputrain.engine.trainer import Trainer
    from gputrain.tasks import build_task

    # torchvision's stem (cifar_stem=false) leaves the blocks 16x fewer FLOPs; a stem holds only leaves, which
    # checkpointing never recomputes, so what is checkpointed stays layer1 .. layer4.
    cfg = load_config("cifar10-resnet18", [f"data.root={root}", "data.image_size=32", "data.num_workers=0",
                                           "model.kwargs.cifar_stem=false", *extra])
    seed_everything(cfg.trainer.seed)
    spec = build_task(cfg)
    trainer = Trainer(cfg, strategy=strategy, devices=devices, accelerator="cpu", batch_size=16 // devices,
                      epochs=2, max_steps_per_epoch=2, activation_checkpointing=checkpointed, loggers=[],
                      enable_checkpointing=False, pictures=0, progress_bar=False, out=out)
    trainer.fit(spec.model, spec.train_data, None, task=spec.task)
    return {k: v.clone() for k, v in trainer.model_state_dict().items()}


PIPELINE = ("parallel.stages=2", "parallel.micro_batches=4", "parallel.schedule=1f1b")


def _two_rank_worker(info, out: str, root: str) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Plain, then checkpointed, under ddp and under pipeline: each fit seeds itself, so one launch (its process
    start-up paid once) runs the four fits of the two tests below."""
    return {strategy: [_fit(f"{out}/{strategy}-{checkpointed}", root, strategy, 2, checkpointed, extra)
                       for checkpointed in (False, True)]
            for strategy, extra in (("ddp", ()), ("pipeline", PIPELINE))}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(make_cifar10(tmp_path_factory.mktemp("ac") / "cifar", train_per_class=4, test_per_class=1))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, root) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Rank 0's weights of each two-rank fit, by strategy: [plain, checkpointed]."""
    return run_ranks(_two_rank_worker, str(tmp_path_factory.mktemp("two_ranks")), root)[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_one_process_trains_the_same_weights_and_buffers_with_and_without(tmp_path, root):
    torch.set_num_threads(1)
    plain = _fit(str(tmp_path / "plain"), root, "single", 1, False)
    checkpointed = _fit(str(tmp_path / "ac"), root, "single", 1, True)
    assert _same(plain, checkpointed) == []  # weights, running statistics and batch counts, bit for bit
    assert int(checkpointed["layer1.0.bn1.num_batches_tracked"]) == 4  # counted once per step, not per recompute


def test_two_ddp_ranks_train_the_same_weights_with_and_without(two_ranks):
    plain, checkpointed = two_ranks["ddp"]
    assert _same(plain, checkpointed) == []


def test_two_pipeline_stages_train_the_same_weights_with_and_without(two_ranks):
    # Each stage recomputes its own blocks in torch's pipeline schedule (its backward is autograd.grad on what the
    # stage received): the same weights and buffers as the plain pipeline, bit for bit.
    plain, checkpointed = two_ranks["pipeline"]
    assert _same(plain, checkpointed) == []


def test_model_parallel_stages_train_the_same_weights_with_and_without(tmp_path, root):
    torch.set_num_threads(1)
    stages = ("parallel.stages=2", "parallel.micro_batches=4")
    plain = _fit(str(tmp_path / "plain"), root, "model_parallel", 1, False, stages)
    checkpointed = _fit(str(tmp_path / "ac"), root, "model_parallel", 1, True, stages)
    assert _same(plain, checkpointed) == []


def test_a_model_without_a_chain_of_blocks_is_refused_in_one_line():
    from gputrain.parallel.activation_checkpoint import checkpoint_blocks

    class Branches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with pytest.raises(ValueError, match=r"^trainer.activation_checkpointing=true: cannot split Branches") as err:
        checkpoint_blocks(Branches())
    assert "\n" not in str(err.value)


def test_the_checkpointed_step_keeps_fewer_activations(root):
    from gputrain.tools.plan import memory
    from gputrain.tools.plan.workload import Workload

    cfg = load_config("cifar10-resnet18", [f"data.root={root}", "data.image_size=64"])
    work = Workload.from_config(cfg, torch.device("cpu"), "32")
    plain, checkpointed = memory.measured_step_memory(work, 8), memory.measured_step_memory(work.checkpointed(), 8)
    assert checkpointed.peak < plain.peak and checkpointed.activations < 0.8 * plain.activations


def test_a_chain_that_wraps_the_models_modules_checkpoints_the_modules_themselves():
    """DeepLabv3+'s chain hands wrappers that carry its tuple state; the model's forward calls what they wrap."""
    from gputrain.models.deeplabv3plus import DeepLabV3Plus
    from gputrain.parallel.activation_checkpoint import checkpoint_blocks, is_checkpointed

    model = DeepLabV3Plus(num_classes=3, backbone="resnet18")
    names = checkpoint_blocks(model)
    assert {"layer1", "layer4", "aspp", "fuse"} <= set(names)
    assert is_checkpointed(model.backbone.layer1) and is_checkpointed(model.aspp) and is_checkpointed(model.fuse)
    model.train()
    model(torch.randn(2, 3, 32, 32))[0].sum().backward()  # runs, recomputing through the real modules
