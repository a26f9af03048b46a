"""Any torchvision model by name (issue 40): the lookup, the head for the data's classes, the input floor, and
each classification family's chain of blocks.

One model of each family trains a step at a small input here (the fast tier); every name torchvision lists trains a
step in tests/e2e/test_zoo_all_models.py (slow).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gputrain.config import ModelConfig
from gputrain.models import build_configured_model, build_model
from gputrain.models.zoo import check_name, derived_kwargs, detects_masks, kind_of, names
from gputrain.parallel.blocks import run_blocks, sequential_blocks

FAMILIES = {  # the smallest member of each classification family, and the side of the input it trains on here
    "resnet34": 32, "regnet_x_400mf": 32, "efficientnet_b0": 32, "mobilenet_v2": 32, "mobilenet_v3_small": 32,
    "convnext_tiny": 32, "vgg11_bn": 32, "alexnet": 64, "densenet121": 32, "shufflenet_v2_x0_5": 32,
    "squeezenet1_1": 32, "mnasnet0_5": 32, "googlenet": 32, "inception_v3": 75, "vit_b_32": 32, "swin_t": 32,
}
"""MaxViT builds only for sides that are multiples of 224 (a 7x7 partition at each of 4 scales): slow tier only."""


def test_each_kind_lists_torchvision_models_and_names_their_kind():
    assert {"resnet50", "convnext_tiny", "vit_b_16"} <= set(names("classification"))
    assert {"fasterrcnn_resnet50_fpn", "retinanet_resnet50_fpn_v2", "ssdlite320_mobilenet_v3_large"} <= set(
        names("detection"))
    assert {"deeplabv3_resnet50", "fcn_resnet50", "lraspp_mobilenet_v3_large"} <= set(names("segmentation"))
    assert kind_of("fcos_resnet50_fpn") == "detection" and kind_of("fcn_resnet50") == "segmentation"
    assert kind_of("not_a_model") is None
    assert not detects_masks("fasterrcnn_resnet50_fpn") and detects_masks("maskrcnn_resnet50_fpn_v2")
    assert detects_masks("mypkg.models:detector")  # a model of your own: as before, masks


def test_an_unknown_name_or_another_kinds_model_is_one_line_with_valid_names():
    with pytest.raises(ValueError, match=r"model.name='resnt34' is not a classification model .*closest: resnet34"):
        check_name("resnt34", "classification", ["resnet18"])
    with pytest.raises(ValueError, match=r"'fasterrcnn_resnet50_fpn' is a torchvision detection model, and this "
                                         r"recipe's task trains a classification model"):
        check_name("fasterrcnn_resnet50_fpn", "classification", [])
    with pytest.raises(ValueError, match="Keypoint R-CNN trains on keypoint targets"):
        check_name("keypointrcnn_resnet50_fpn", "detection", [])
    check_name("retinanet_resnet50_fpn", "detection", [])  # a valid one passes


def test_builtin_names_keep_their_meaning():
    cifar = build_model("resnet18", num_classes=10)  # gputrain's CIFAR ResNet-18 (3x3 stem), not torchvision's
    assert cifar.conv1.kernel_size == (3, 3)
    cfg = ModelConfig(name="resnet34")
    model = build_configured_model(cfg, "resnet18", kind="classification", num_classes=7, input_size=(32, 32))
    assert model.conv1.kernel_size == (7, 7) and model.fc.out_features == 7
    assert cfg.kwargs == {"num_classes": 7}  # recorded with the run: eval and export rebuild the same model
    assert build_model(cfg.name, **cfg.kwargs).fc.out_features == 7


def test_the_input_floor_is_refused_in_one_line_and_fixed_sizes_follow_the_data():
    with pytest.raises(ValueError, match=r"'inception_v3' needs images of at least 75x75 px and the data gives "
                                         r"32x32; set data.image_size=75"):
        derived_kwargs("inception_v3", "classification", (32, 32))
    assert derived_kwargs("vit_b_16", "classification", (64, 64))["image_size"] == 64
    assert derived_kwargs("googlenet", "classification", (32, 32))["aux_logits"] is False
    with pytest.raises(ValueError, match=r"model.name='maxvit_t' cannot be built with .*partition size 7.*"
                                         r"choose data.image_size"):
        build_model("maxvit_t", num_classes=3, input_size=[64, 64])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_model_of_each_family_trains_a_step_and_its_chain_is_its_forward(name):
    side = FAMILIES[name]
    torch.manual_seed(0)
    model = build_configured_model(ModelConfig(name=name), "", kind="classification", num_classes=3,
                                   input_size=(side, side))
    x, y = torch.randn(2, 3, side, side), torch.tensor([0, 2])
    model.eval()  # the chain first, on the fresh model: a step on 2 images at 32 px may well diverge (1x1 BatchNorm)
    try:
        blocks = sequential_blocks(model)
    except ValueError as err:  # not a chain: refused, naming the strategies that work
        assert name in ("googlenet", "inception_v3", "vit_b_32")
        assert "train it with strategy single, ddp, dp or fsdp" in str(err)
    else:
        assert name not in ("googlenet", "inception_v3", "vit_b_32")
        with torch.no_grad():
            torch.testing.assert_close(run_blocks(blocks, x), model(x), rtol=0, atol=0)
        assert all("." not in block for block, _ in blocks)  # block names are module names (a Stage registers them)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_an_auxiliary_head_adds_half_its_loss_and_evaluation_reads_the_main_output():
    from gputrain.tasks.segmentation import SegmentationTask

    task, targets = SegmentationTask(num_classes=3), torch.randint(0, 3, (2, 8, 8))
    out, aux = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    alone = task.loss(out, targets)
    assert task.loss({"out": out, "aux": aux}, targets) == pytest.approx(float(alone + 0.5 * task.loss(aux, targets)))
    assert task.loss({"out": out}, targets) == pytest.approx(float(alone))


def test_naming_another_model_drops_the_recipes_model_options_and_keeps_those_given_with_it(capsys):
    from gputrain.config import load_config

    cfg = load_config("cifar10-resnet18", ["model.name=efficientnet_b0", "model.kwargs.dropout=0.1"])
    assert cfg.model.kwargs == {"dropout": 0.1}
    assert "model.name=efficientnet_b0 replaces resnet18; dropped its model.kwargs (cifar_stem=True), options" in \
        capsys.readouterr().out
    assert load_config("cifar10-resnet18", ["model.kwargs.cifar_stem=false"]).model.kwargs == {"cifar_stem": False}
    assert load_config("cifar10-resnet18", ["model.name=resnet18"]).model.kwargs == {"cifar_stem": True}


def test_activation_checkpointing_leaves_out_a_head_that_overwrites_its_input_and_keeps_the_gradients():
    from gputrain.parallel.activation_checkpoint import checkpoint_blocks

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = build_model("efficientnet_b0", num_classes=3)  # its head: Dropout(inplace=True), Linear
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) or type(module).__name__ == "StochasticDepth":
                module.p = 0.0
        names = checkpoint_blocks(model) if checkpointed else []
        assert "classifier" not in names and ("features_1" in names) == checkpointed
        F.cross_entropy(model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))),
                        torch.tensor([0, 2])).backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fsdp_units_are_found_from_each_models_structure():
    from gputrain.strategies.fsdp import shard_units

    # Each stage inside the features Sequential is a unit; the last stage, over half of the model, splits into blocks.
    convnext = shard_units(build_model("convnext_tiny", num_classes=3))
    assert convnext == ["features.1", "features.3", "features.4", "features.5", "features.6", "features.7.0",
                        "features.7.1", "features.7.2"]
    regnet = shard_units(build_model("regnet_x_400mf", num_classes=3))
    assert regnet[:3] == ["trunk_output.block2", "trunk_output.block3", "trunk_output.block4.block4-0"]


def test_a_segmenter_without_its_auxiliary_head_is_a_chain_and_the_others_are_refused():
    x = torch.randn(2, 3, 40, 40)
    for name in ("deeplabv3_mobilenet_v3_large", "fcn_resnet50"):
        model = build_model(name, num_classes=3, weights_backbone=None, aux_loss=False).eval()
        blocks = sequential_blocks(model)
        assert [b for b, _ in blocks][-2:] == ["classifier", "upsample"]
        with torch.no_grad():  # the chain returns the logits the model returns as {"out": logits}, at the input size
            torch.testing.assert_close(run_blocks(blocks, x), model(x)["out"], rtol=0, atol=0)
    for model in (build_model("deeplabv3_mobilenet_v3_large", num_classes=3, weights_backbone=None, aux_loss=True),
                  build_model("lraspp_mobilenet_v3_large", num_classes=3, weights_backbone=None)):
        with pytest.raises(ValueError, match="into a chain of blocks .* train it with strategy single, ddp, dp or fsdp"):
            sequential_blocks(model)


def test_an_option_the_builder_sets_itself_says_to_drop_it_and_a_misspelled_one_is_named(capsys):
    with pytest.raises(ValueError, match=r"got multiple values for argument 'min_size'; drop model.kwargs.min_size"):
        build_model("ssdlite320_mobilenet_v3_large", num_classes=3, weights_backbone=None, min_size=512)
    build_model("mobilenet_v3_small", num_classes=3, dropuot=0.3)  # MobileNetV3 takes **kwargs and drops them
    assert capsys.readouterr().err.strip() == ("gputrain: model.kwargs dropuot: no option of that name in "
                                               "mobilenet_v3_small's builder or MobileNetV3; it may be ignored "
                                               "(check the spelling)")
    build_model("mobilenet_v3_small", num_classes=3, dropuot=0.3)  # eval and predict build twice: named once
    build_model("mobilenet_v3_small", num_classes=3, dropout=0.3)
    assert capsys.readouterr().err == ""


def test_a_builtin_or_users_builder_given_an_option_it_lacks_is_one_line_naming_the_closest():
    # Found by a new user (round 5): model.kwargs.widht reached Python's TypeError from inside the builder.
    with pytest.raises(ValueError, match=r"^model.kwargs.widht: model.name='conv_autoencoder' takes no option 'widht'; "
                                         r"drop it \(its options: weights_path\)$"):
        build_model("conv_autoencoder", widht=3)
    with pytest.raises(ValueError, match=r"takes no option 'num_clases'; did you mean model.kwargs.num_classes\?$"):
        build_model("resnet18", num_clases=3)
    assert build_model("resnet18", num_classes=3).fc.out_features == 3
