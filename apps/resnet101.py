"""ResNet-101 on 3x224x224 images, 1000 classes.

Paper: He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016,
Table 1, the 101-layer column: conv1 7x7/2 64 and a 3x3/2 max pool, then bottleneck blocks
(1x1, 3x3, 1x1 convolutions of widths w, w, 4w, each followed by batch norm) in four stages
of 3, 4, 23 and 3 blocks with w = 64, 128, 256, 512; the first block of a stage projects its
shortcut with a 1x1 convolution (option B) and, from the second stage on, halves the image;
global average pool, fc 1000. Convolutions have no bias. The stride sits on the 3x3
convolution, as in torchvision (the parameter count is the same either way): 44,549,160.

Tiny: the same stem and bottleneck blocks at 3x32x32, widths 8, 16, 32, 64, one block a
stage, 10 classes. Data: class c is a coarse random pattern of its own stretched over the
image, plus noise.

    python -m apps.resnet101 [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

from apps import synthetic
from apps.cli import App, run

FULL = {"image": 224, "widths": (64, 128, 256, 512), "blocks": (3, 4, 23, 3), "classes": 1000}
TINY = {"image": 32, "widths": (8, 16, 32, 64), "blocks": (1, 1, 1, 1), "classes": 10}
EXPANSION = 4


def conv_bn(model, x, channels, kernel, stride=1, padding=0, relu=True, name=""):
    """conv (no bias) -> batch norm (-> relu, fused)."""
    h = model.conv2d(x, channels, kernel, stride=stride, padding=padding, use_bias=False, name=f"{name}.conv")
    return model.batch_norm(h, relu=relu, name=f"{name}.bn")


def bottleneck(model, x, width, stride, name):
    """relu(1x1 -> 3x3 (stride) -> 1x1 (4 * width) + shortcut); the shortcut projects when the shape changes."""
    h = conv_bn(model, x, width, 1, name=f"{name}.a")
    h = conv_bn(model, h, width, 3, stride=stride, padding=1, name=f"{name}.b")
    h = conv_bn(model, h, EXPANSION * width, 1, relu=False, name=f"{name}.c")
    if stride != 1 or x.shape[1] != EXPANSION * width:
        x = conv_bn(model, x, EXPANSION * width, 1, stride=stride, relu=False, name=f"{name}.proj")
    return model.relu(model.add(h, x, name=f"{name}.add"), name=f"{name}.relu")


def build(model, batch_size, dtype="float32", image=224, widths=(64, 128, 256, 512), blocks=(3, 4, 23, 3),
          classes=1000):
    """images [batch, 3, image, image] -> class probabilities [batch, classes]."""
    h = model.input((batch_size, 3, image, image), dtype, name="images")
    h = conv_bn(model, h, widths[0], 7, stride=2, padding=3, name="conv1")
    h = model.pool2d(h, 3, 2, padding=1, name="pool1")
    for stage, (width, count) in enumerate(zip(widths, blocks)):
        for i in range(count):
            stride = 2 if i == 0 and stage > 0 else 1
            h = bottleneck(model, h, width, stride, name=f"layer{stage + 1}.{i}")
    h = model.flat(model.pool2d(h, h.shape[2:], pool_type="avg", name="avgpool"), name="flat")
    return model.softmax(model.dense(h, classes, name="fc"), name="prob")


def make_batch(rng, model, batch_size, sizes):
    """(images, labels): each class a coarse pattern of its own, plus noise."""
    return synthetic.images(rng, model.seed, batch_size, sizes["classes"], (3, sizes["image"], sizes["image"]))


#: the app: its name, graph, sizes, batches and training defaults
APP = App("resnet101", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, lr=0.1,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
