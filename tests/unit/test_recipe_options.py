"""The reference recipe's per-sample options (issue 44, first part): crop scale, flip probability, auto-augment
policies, random erasing, training and validation sizes, label smoothing, and norm and bias weight decay.

Each option is checked by what it does to an image or a gradient, with the defaults augmenting exactly as before;
a hand-written loop with the reference's formulas (``CrossEntropyLoss(label_smoothing)``, its ``set_weight_decay``
groups, its ``ExponentialMovingAverage`` with its decay adjustment and warm-up restarts) trains the same weights and
moving average as gputrain; and every bad value is one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchvision.transforms import v2

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig, SchedulerConfig, load_config
from gputrain.data.classfolder import classification_transform
from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD
from gputrain.data.samplers import SeededSamples
from gputrain.tasks.classification import ClassificationTask, _classfolder_train, eval_preprocess

IMAGE = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _train(overrides: list[str], seed: int, *, normalize: bool = True) -> torch.Tensor:
    cfg = load_config("imagefolder-resnet50", ["data.image_size=32", *overrides])
    transform = _classfolder_train(cfg, normalize=normalize)
    torch.manual_seed(seed)
    return transform(IMAGE)


def test_the_defaults_augment_exactly_as_before():
    for seed in range(5):
        torch.manual_seed(seed)
        before = classification_transform(32, train=True)(IMAGE)
        assert torch.equal(_train([], seed), before)


def test_crop_scale_flip_policy_and_erasing_each_change_the_image_as_they_say():
    seeds = range(8)
    # hflip=1 mirrors exactly what hflip=0 gives (the crop draws first, the same way).
    for seed in seeds:
        assert torch.equal(_train(["data.hflip=1.0"], seed), _train(["data.hflip=0"], seed).flip(-1))
    # A crop scale of [1, 1] keeps the whole image's area: no two seeds crop differently in size.
    whole = [_train(["data.crop_scale=[1.0,1.0]", "data.hflip=0"], s) for s in seeds]
    assert all(torch.equal(whole[0], w) for w in whole[1:])
    assert not all(torch.equal(_train(["data.hflip=0"], 0), _train(["data.hflip=0"], s)) for s in seeds)
    # A policy changes the pixels the crop and flip gave, the same way for the same seed.
    for policy in ("ta_wide", "ra", "augmix", "imagenet"):
        augmented = [_train([f"data.auto_augment={policy}"], s) for s in seeds]
        assert any(not torch.equal(a, _train([], s)) for a, s in zip(augmented, seeds, strict=True)), policy
        assert torch.equal(augmented[3], _train([f"data.auto_augment={policy}"], 3))
    # Erasing with probability 1 sets a rectangle to 0 after normalisation (the reference's), to the mean pixel on
    # uint8 (what the device's normalisation makes 0); the rest of the image is untouched.
    for seed in seeds:
        plain, erased = _train([], seed), _train(["data.random_erase=1.0"], seed)
        changed = (plain != erased).any(0)
        assert changed.any() and (erased[:, changed] == 0).all()
        on_uint8 = _train(["data.random_erase=1.0"], seed, normalize=False)
        mean_pixel = torch.tensor([round(m * 255) for m in IMAGENET_MEAN], dtype=torch.uint8)
        assert (on_uint8[:, changed] == mean_pixel[:, None]).all()


def test_sizes_follow_the_reference_resize_then_centre_crop():
    cfg = load_config("imagefolder-resnet50", ["data.val_resize_size=36", "data.val_crop_size=32",
                                               "data.train_crop_size=24", "data.interpolation=bicubic"])
    want = v2.Compose([v2.Resize(36, interpolation=v2.InterpolationMode.BICUBIC, antialias=True), v2.CenterCrop(32),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))])
    torch.testing.assert_close(eval_preprocess(cfg)(IMAGE), want(IMAGE), rtol=0, atol=0)
    assert _classfolder_train(cfg, normalize=True)(IMAGE).shape == (3, 24, 24)


def test_each_sample_is_augmented_the_same_way_wherever_and_whenever_it_is_read():
    class Augmented(torch.utils.data.Dataset):
        transform = _classfolder_train(load_config("imagefolder-resnet50", [
            "data.image_size=32", "data.auto_augment=ta_wide", "data.random_erase=0.5"]), normalize=True)

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.transform(IMAGE)

    data = SeededSamples(Augmented(), seed=3)
    forward = [data[(1, i)] for i in range(4)]
    backward = [data[(1, i)] for i in reversed(range(4))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    assert not torch.equal(forward[0], forward[1])


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.auto_augment=trivial"], "data.auto_augment='trivial' is unknown; choose ta_wide, ra, augmix, imagenet"),
    (["data.val_resize_size=200"], "data.val_resize_size=200 is smaller than the validation crop 224"),
    (["data.crop_scale=[0.9,0.2]"], "data.crop_scale=[0.9, 0.2] must be two numbers [low, high] with low <= high"),
    (["data.hflip=1.5"], "data.hflip=1.5 must be"),
    (["optim.label_smoothing=1.0"], "optim.label_smoothing=1.0 must be"),
    (["data.interpolation=lanczos"], "data.interpolation='lanczos' is unknown; choose nearest, bilinear, bicubic"),
])
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("imagefolder-resnet50", overrides)


def test_classification_options_on_another_task_are_refused():
    for recipe in ("ade20k-deeplabv3plus", "coco-maskrcnn", "autoencoder"):
        with pytest.raises(ValueError, match="optim.label_smoothing=0.1 applies to classification, and task"):
            load_config(recipe, ["optim.label_smoothing=0.1"])
    with pytest.raises(ValueError, match="data.auto_augment='ra' applies to classification"):
        load_config("ade20k-deeplabv3plus", ["data.auto_augment=ra"])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.LayerNorm(4 * 6 * 6), nn.Linear(4 * 6 * 6, 3))


def _reference_groups(model: nn.Module, weight_decay: float, norm_decay: float, bias_decay: float) -> list[dict]:
    """torchvision's references/classification/utils.py ``set_weight_decay`` with custom key ("bias", ...), written
    out: a parameter named bias first, then a normalisation layer's, then the rest."""
    norm_classes = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                    nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
    groups: dict[str, list] = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            key = "bias" if name == "bias" else "norm" if isinstance(module, norm_classes) else "other"
            groups[key].append(p)
    decay = {"other": weight_decay, "norm": norm_decay, "bias": bias_decay}
    return [{"params": groups[k], "weight_decay": decay[k]} for k in groups if groups[k]]


class _ReferenceEMA(torch.optim.swa_utils.AveragedModel):
    """torchvision's references/classification/utils.py ``ExponentialMovingAverage``, written out: an averaged
    model over parameters and buffers with ``decay * average + (1 - decay) * weights``."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__(model, avg_fn=lambda average, weights, _: decay * average + (1 - decay) * weights,
                         use_buffers=True)


def test_label_smoothing_norm_and_bias_decay_and_ema_train_what_the_references_formulas_train(tmp_path):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    optim = OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.05, label_smoothing=0.1,
                        norm_weight_decay=0.0, bias_weight_decay=0.01)
    cfg = RunConfig(task="classification", optim=optim, scheduler=SchedulerConfig(warmup_steps=4))
    trainer = Trainer(cfg, strategy="single", accelerator="cpu", batch_size=16,
                      epochs=20, ema_decay=0.995, ema_every_n_steps=2,
                      out=str(tmp_path), progress_bar=False, loggers=[], enable_checkpointing=False)
    trainer.fit(_net(), data, task=ClassificationTask(3, label_smoothing=0.1))
    ours = trainer.strategy.model_state_dict(trainer.module)
    assert trainer.loop is not None and trainer.loop.ema is not None
    ours_ema = trainer.loop.ema.full_state()

    model = _net()  # the hand-written loop: one full batch per step, 20 steps, 4 of warm-up
    sgd = torch.optim.SGD(_reference_groups(model, 0.05, 0.0, 0.01), lr=0.1, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: (step + 1) / 4 if step < 4 else 1.0)
    # The reference's adjustment: alpha = (1 - decay) x world size x batch x model_ema_steps / epochs.
    ema = _ReferenceEMA(model, decay=1 - min(1.0, (1 - 0.995) * 16 * 2 / 20))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    for step in range(1, 21):
        sgd.zero_grad()
        criterion(model(data.tensors[0]), data.tensors[1]).backward()
        sgd.step()
        warmup.step()
        if (step - 1) % 2 == 0:  # after steps 1, 3, 5, ...: the reference's iterations 0, 2, 4, ...
            ema.update_parameters(model)
            if step <= 4:  # in the warm-up the reference restarts its average at every update
                ema.n_averaged.fill_(0)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), _net().state_dict().values(),
                                                          strict=True) if a.is_floating_point())
    assert moved > 1e-2
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-6, msg=key)
    lag = max(float((a - b).abs().max()) for a, b in zip(ema.module.state_dict().values(),
                                                        model.state_dict().values(), strict=True) if a.is_floating_point())
    assert lag > 1e-3  # the average trails the weights: it is not a copy
    for key, value in ema.module.state_dict().items():  # an integer buffer (num_batches_tracked) is copied here
        if value.is_floating_point():
            torch.testing.assert_close(ours_ema[key], value, rtol=0, atol=1e-6, msg=key)
    smoothed = ClassificationTask(3, label_smoothing=0.1).loss(torch.eye(3) * 4, torch.arange(3))
    assert float(smoothed) == pytest.approx(float(F.cross_entropy(torch.eye(3) * 4, torch.arange(3),
                                                                  label_smoothing=0.1)))
    assert float(smoothed) > float(F.cross_entropy(torch.eye(3) * 4, torch.arange(3)))


def test_the_recipes_label_smoothing_reaches_the_tasks_loss(tmp_path):
    from gputrain.data.classfolder import make_classfolder
    from gputrain.tasks import build_task

    make_classfolder(tmp_path / "cls", classes=3, per_class=2, size=32, seed=0)
    cfg = load_config("imagefolder-resnet50", [f"data.root={tmp_path / 'cls'}", "data.image_size=32",
                                               "optim.label_smoothing=0.2", "model.name=resnet18"])
    logits, targets = torch.randn(4, 3, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 1])
    got = build_task(cfg).task.loss(logits, targets)
    assert float(got) == pytest.approx(float(F.cross_entropy(logits, targets, label_smoothing=0.2)))


def test_a_policy_with_bicubic_crops_runs_bilinear_as_torchvision_allows_on_tensors():
    assert _train(["data.auto_augment=ra", "data.interpolation=bicubic"], 0).shape == (3, 32, 32)


def test_a_batch_of_one_at_batchnorm_says_how_to_avoid_it(tmp_path):
    data = TensorDataset(torch.randn(5, 3, 6, 6), torch.randint(0, 3, (5,)))  # batches of 4 and 1
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.1)), strategy="single", accelerator="cpu",
                      batch_size=4, epochs=1, out=str(tmp_path), progress_bar=False, loggers=[])
    net = nn.Sequential(nn.Flatten(), nn.Linear(108, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))  # 1 value a channel
    with pytest.raises(ValueError, match=r"a training micro-batch of 1 sample\(s\) reached BatchNorm, .*set "
                                         r"trainer.drop_last=true"):
        trainer.fit(net, data, loss=F.cross_entropy)
