"""The vision models of the zoo: torchvision classifiers and segmentation heads, and a U-Net.

Every model is built with random weights (no download), 10 classes, and trained on small
random images (batch 2, 64x64: the last BatchNorms of the CNNs still see 8 values per channel;
32x32 for the ViTs) with SGD and momentum, except the transformers
(ViT, ConvNeXt), which use AdamW. Dropout and StochasticDepth probabilities are set to 0 by
the harness so that the loss curves can be compared with PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zoo.harness import ADAMW, ZooCase
from zoo.torchvision_import import torchvision_models

CLASSES = 10
BATCH = 2


def _images(size: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    def draw(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(BATCH, 3, size, size, generator=g),)

    return draw


def _classes(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, CLASSES, (inputs[0].shape[0],), generator=g)


def _pixel_classes(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    n, _, h, w = inputs[0].shape
    return torch.randint(0, CLASSES, (n, h, w), generator=g)


class SegmentationOutput(nn.Module):
    """A torchvision segmentation model's ``"out"`` logits (it returns a dict)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A two-level U-Net: double 3x3 Conv-BatchNorm-ReLU blocks, MaxPool down, ConvTranspose
    up, skip connections concatenated, a 1x1 Conv to per-pixel class logits."""

    def __init__(self, classes: int = CLASSES, width: int = 8) -> None:
        super().__init__()
        self.down1 = _block(3, width)
        self.down2 = _block(width, 2 * width)
        self.bottom = _block(2 * width, 4 * width)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        b = self.bottom(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


class SpatialTransformer(nn.Module):
    """PyTorch's spatial transformer network tutorial's model at 3 x 32 x 32: a localization
    network predicts an affine transform (starting at the identity), ``affine_grid`` and
    ``grid_sample`` warp the image, and a small CNN classifies the warped image."""

    def __init__(self) -> None:
        super().__init__()
        self.localization = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=7), nn.MaxPool2d(2, stride=2), nn.ReLU(True),
            nn.Conv2d(8, 10, kernel_size=5), nn.MaxPool2d(2, stride=2), nn.ReLU(True),
        )  # fmt: skip
        self.fc_loc = nn.Sequential(nn.Linear(10 * 4 * 4, 32), nn.ReLU(True), nn.Linear(32, 6))
        with torch.no_grad():
            self.fc_loc[2].weight.mul_(0.1)
            self.fc_loc[2].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
        self.features = nn.Sequential(
            nn.Conv2d(3, 10, kernel_size=5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(10, 20, kernel_size=5), nn.MaxPool2d(2), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(20 * 5 * 5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.fc_loc(self.localization(x).flatten(1)).view(-1, 2, 3)
        grid = nn.functional.affine_grid(theta, list(x.size()), align_corners=False)
        warped = nn.functional.grid_sample(x, grid, align_corners=False)
        return self.head(self.features(warped).flatten(1))


def _classifier(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return getattr(torchvision_models(), name)(num_classes=CLASSES, **kwargs)

    return build


def _segmentation(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        segmentation = torchvision_models().segmentation
        model = getattr(segmentation, name)(
            weights=None, weights_backbone=None, num_classes=CLASSES, aux_loss=False
        )
        return SegmentationOutput(model)

    return build


def _vit(image: int, patch: int, layers: int, heads: int, width: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        vit = torchvision_models().vision_transformer
        return vit.VisionTransformer(
            image_size=image,
            patch_size=patch,
            num_layers=layers,
            num_heads=heads,
            hidden_dim=width,
            mlp_dim=4 * width,
            num_classes=CLASSES,
        )

    return build


def _case(name: str, build: Callable[[], nn.Module], size: int = 64, **kw: object) -> ZooCase:
    return ZooCase(name, build, _images(size), _classes, **kw)  # type: ignore[arg-type]


def _seg_case(name: str, build: Callable[[], nn.Module], size: int, **kw: object) -> ZooCase:
    return ZooCase(name, build, _images(size), _pixel_classes, **kw)  # type: ignore[arg-type]


_ADAPTIVE_POOL = (
    "the TorchScript exporter has no conversion of adaptive_avg_pool2d to an output size that"
    " does not divide the input's (AlexNet's 6 x 6 from 64 x 64 images): SymbolicValueError"
)

_AFFINE_GRID = (
    "the TorchScript exporter converts affine_grid from opset 20 on, and the zoo exports with it"
    " at opset 17: UnsupportedOperatorError for aten::affine_grid_generator"
)

VISION_CASES = [
    _case("resnet18", _classifier("resnet18")),
    _case("resnet50", _classifier("resnet50"), slow=True),
    _case("mobilenet_v2", _classifier("mobilenet_v2")),
    _case("mobilenet_v3_small", _classifier("mobilenet_v3_small")),
    _case("efficientnet_b0", _classifier("efficientnet_b0")),
    _case("shufflenet_v2_x0_5", _classifier("shufflenet_v2_x0_5")),
    _case("squeezenet1_1", _classifier("squeezenet1_1")),
    _case("regnet_y_400mf", _classifier("regnet_y_400mf")),
    _case("convnext_tiny", _classifier("convnext_tiny"), optimizer=ADAMW, slow=True),
    _case("vit_small", _vit(image=32, patch=8, layers=2, heads=4, width=64), 32, optimizer=ADAMW),
    _case("vit_b_16", _classifier("vit_b_16", image_size=32), 32, optimizer=ADAMW, slow=True),
    _seg_case("lraspp_mobilenet_v3_large", _segmentation("lraspp_mobilenet_v3_large"), 64),
    _seg_case(
        "deeplabv3_mobilenet_v3_large",
        _segmentation("deeplabv3_mobilenet_v3_large"),
        64,
        slow=True,
    ),
    _seg_case("fcn_resnet50", _segmentation("fcn_resnet50"), 64, slow=True),
    _seg_case("unet", UNet, 64),
    _case("spatial_transformer", SpatialTransformer, 32, xfail={"torchscript": _AFFINE_GRID}),
    # more families, slow: dense and inception blocks, grouped convs, shifted windows
    _case("densenet121", _classifier("densenet121"), slow=True),
    _case("googlenet", _classifier("googlenet", aux_logits=False, init_weights=True), slow=True),
    _case("resnext50_32x4d", _classifier("resnext50_32x4d"), slow=True),
    _case("mnasnet0_5", _classifier("mnasnet0_5"), slow=True),
    _case("mobilenet_v3_large", _classifier("mobilenet_v3_large"), slow=True),
    _case("regnet_x_400mf", _classifier("regnet_x_400mf"), slow=True),
    _case("efficientnet_v2_s", _classifier("efficientnet_v2_s"), slow=True),
    _case("swin_t", _classifier("swin_t"), optimizer=ADAMW, slow=True),
    _case("alexnet", _classifier("alexnet"), slow=True, xfail={"torchscript": _ADAPTIVE_POOL}),
]
"""The vision models; the ones at a real width (ResNet-50, ConvNeXt-T, ViT-B/16, FCN on
ResNet-50) and the further families after the U-Net are slow."""
