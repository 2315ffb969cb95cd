"""Inception-v3 on 3x299x299 images, 1000 classes.

Paper: Szegedy, Vanhoucke, Ioffe, Shlens, Wojna, "Rethinking the Inception Architecture for
Computer Vision", CVPR 2016: Table 1's stem, three 35x35 modules (figure 5), a grid
reduction, four 17x17 modules with 7x7 convolutions factorized into 1x7 and 7x1 (figure 6),
a second reduction, and two 8x8 modules with 3x3 convolutions expanded into 1x3 and 3x1
(figure 7); the auxiliary classifier on the last 17x17 grid. Branch widths are those of the
released model (the paper's table gives only stage widths), as in torchvision's
inception_v3: stem 32, 32, 64, 80, 192; Mixed_5b-d (pool branch 32, 64, 64); Mixed_6a;
Mixed_6b-e (7x7 branches of 128, 160, 160, 192); Mixed_7a; Mixed_7b-c; global average pool,
dropout 0.5, fc 1000. Every convolution is conv (no bias), batch norm (eps 0.001), relu.
23,834,568 parameters without the auxiliary head, 27,161,264 with it.

The auxiliary head is off by default (`aux=True` builds it, for counting; the Model API
trains one loss, so the app trains the main head). Tiny: the same modules at 3x75x75 (the
smallest input the stem and reductions allow) with an eighth of every width, 10 classes.
Data: class c is a coarse random pattern of its own stretched over the image, plus noise.

    python -m apps.inception_v3 [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

from apps import synthetic
from apps.cli import App, run

FULL = {"image": 299, "width": 1.0, "classes": 1000, "aux": False, "dropout": 0.5}
TINY = {"image": 75, "width": 0.125, "classes": 10, "aux": False, "dropout": 0.5}


class Builder:
    """Adds Inception-v3's layers to a model; every channel count is scaled by `width`."""

    def __init__(self, model, width: float):
        self.m, self.width = model, width

    def ch(self, channels: int) -> int:
        return max(1, round(channels * self.width))

    def conv(self, x, channels, kernel, stride=1, padding=0, name=""):
        """torchvision's BasicConv2d: conv (no bias) -> batch norm (eps 0.001) -> relu."""
        h = self.m.conv2d(x, self.ch(channels), kernel, stride=stride, padding=padding, use_bias=False,
                          name=f"{name}.conv")
        return self.m.batch_norm(h, eps=0.001, relu=True, name=f"{name}.bn")

    def avg3(self, x, name):
        return self.m.pool2d(x, 3, 1, padding=1, pool_type="avg", name=name)

    def max3(self, x, name):
        return self.m.pool2d(x, 3, 2, name=name)

    def cat(self, branches, name):
        return self.m.concat(branches, axis=1, name=name)

    def module_a(self, x, pool_features, name):
        """35x35 (figure 5): 1x1; 1x1 -> 5x5; 1x1 -> 3x3 -> 3x3; avg pool -> 1x1."""
        b1 = self.conv(x, 64, 1, name=f"{name}.branch1x1")
        b5 = self.conv(self.conv(x, 48, 1, name=f"{name}.branch5x5_1"), 64, 5, padding=2, name=f"{name}.branch5x5_2")
        b3 = self.conv(x, 64, 1, name=f"{name}.branch3x3dbl_1")
        b3 = self.conv(b3, 96, 3, padding=1, name=f"{name}.branch3x3dbl_2")
        b3 = self.conv(b3, 96, 3, padding=1, name=f"{name}.branch3x3dbl_3")
        bp = self.conv(self.avg3(x, f"{name}.pool"), pool_features, 1, name=f"{name}.branch_pool")
        return self.cat([b1, b5, b3, bp], name)

    def reduction_a(self, x, name):
        """35x35 -> 17x17: 3x3/2; 1x1 -> 3x3 -> 3x3/2; max pool 3x3/2."""
        b3 = self.conv(x, 384, 3, stride=2, name=f"{name}.branch3x3")
        bd = self.conv(x, 64, 1, name=f"{name}.branch3x3dbl_1")
        bd = self.conv(bd, 96, 3, padding=1, name=f"{name}.branch3x3dbl_2")
        bd = self.conv(bd, 96, 3, stride=2, name=f"{name}.branch3x3dbl_3")
        return self.cat([b3, bd, self.max3(x, f"{name}.pool")], name)

    def module_c(self, x, c7, name):
        """17x17 (figure 6): 1x1; 1x1 -> 1x7 -> 7x1; 1x1 -> 7x1 -> 1x7 -> 7x1 -> 1x7; avg pool -> 1x1."""
        b1 = self.conv(x, 192, 1, name=f"{name}.branch1x1")
        b7 = self.conv(x, c7, 1, name=f"{name}.branch7x7_1")
        b7 = self.conv(b7, c7, (1, 7), padding=(0, 3), name=f"{name}.branch7x7_2")
        b7 = self.conv(b7, 192, (7, 1), padding=(3, 0), name=f"{name}.branch7x7_3")
        bd = self.conv(x, c7, 1, name=f"{name}.branch7x7dbl_1")
        for i, (out, k, p) in enumerate([(c7, (7, 1), (3, 0)), (c7, (1, 7), (0, 3)), (c7, (7, 1), (3, 0)),
                                         (192, (1, 7), (0, 3))]):
            bd = self.conv(bd, out, k, padding=p, name=f"{name}.branch7x7dbl_{i + 2}")
        bp = self.conv(self.avg3(x, f"{name}.pool"), 192, 1, name=f"{name}.branch_pool")
        return self.cat([b1, b7, bd, bp], name)

    def reduction_b(self, x, name):
        """17x17 -> 8x8: 1x1 -> 3x3/2; 1x1 -> 1x7 -> 7x1 -> 3x3/2; max pool 3x3/2."""
        b3 = self.conv(self.conv(x, 192, 1, name=f"{name}.branch3x3_1"), 320, 3, stride=2, name=f"{name}.branch3x3_2")
        b7 = self.conv(x, 192, 1, name=f"{name}.branch7x7x3_1")
        b7 = self.conv(b7, 192, (1, 7), padding=(0, 3), name=f"{name}.branch7x7x3_2")
        b7 = self.conv(b7, 192, (7, 1), padding=(3, 0), name=f"{name}.branch7x7x3_3")
        b7 = self.conv(b7, 192, 3, stride=2, name=f"{name}.branch7x7x3_4")
        return self.cat([b3, b7, self.max3(x, f"{name}.pool")], name)

    def module_e(self, x, name):
        """8x8 (figure 7): 1x1; 1x1 -> (1x3 | 3x1); 1x1 -> 3x3 -> (1x3 | 3x1); avg pool -> 1x1."""
        b1 = self.conv(x, 320, 1, name=f"{name}.branch1x1")
        b3 = self.conv(x, 384, 1, name=f"{name}.branch3x3_1")
        b3 = self.cat([self.conv(b3, 384, (1, 3), padding=(0, 1), name=f"{name}.branch3x3_2a"),
                       self.conv(b3, 384, (3, 1), padding=(1, 0), name=f"{name}.branch3x3_2b")], f"{name}.cat3x3")
        bd = self.conv(x, 448, 1, name=f"{name}.branch3x3dbl_1")
        bd = self.conv(bd, 384, 3, padding=1, name=f"{name}.branch3x3dbl_2")
        bd = self.cat([self.conv(bd, 384, (1, 3), padding=(0, 1), name=f"{name}.branch3x3dbl_3a"),
                       self.conv(bd, 384, (3, 1), padding=(1, 0), name=f"{name}.branch3x3dbl_3b")],
                      f"{name}.cat3x3dbl")
        bp = self.conv(self.avg3(x, f"{name}.pool"), 192, 1, name=f"{name}.branch_pool")
        return self.cat([b1, b3, bd, bp], name)

    def aux_head(self, x, classes):
        """The auxiliary classifier: avg pool 5x5/3, 1x1 128, 5x5 768, global average pool, fc."""
        h = self.m.pool2d(x, 5, 3, pool_type="avg", name="aux.pool")
        h = self.conv(h, 128, 1, name="aux.conv0")
        h = self.conv(h, 768, 5, name="aux.conv1")
        h = self.m.flat(self.m.pool2d(h, h.shape[2:], pool_type="avg", name="aux.avgpool"), name="aux.flat")
        return self.m.dense(h, classes, name="aux.fc")


def build(model, batch_size, dtype="float32", image=299, width=1.0, classes=1000, aux=False, dropout=0.5):
    """images [batch, 3, image, image] -> class probabilities [batch, classes] (the main head)."""
    b = Builder(model, width)
    h = model.input((batch_size, 3, image, image), dtype, name="images")
    h = b.conv(h, 32, 3, stride=2, name="Conv2d_1a_3x3")
    h = b.conv(h, 32, 3, name="Conv2d_2a_3x3")
    h = b.conv(h, 64, 3, padding=1, name="Conv2d_2b_3x3")
    h = b.max3(h, "maxpool1")
    h = b.conv(h, 80, 1, name="Conv2d_3b_1x1")
    h = b.conv(h, 192, 3, name="Conv2d_4a_3x3")
    h = b.max3(h, "maxpool2")
    for name, pool_features in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
        h = b.module_a(h, pool_features, name)
    h = b.reduction_a(h, "Mixed_6a")
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        h = b.module_c(h, c7, name)
    if aux:
        b.aux_head(h, classes)
    h = b.reduction_b(h, "Mixed_7a")
    h = b.module_e(h, "Mixed_7b")
    h = b.module_e(h, "Mixed_7c")
    h = model.flat(model.pool2d(h, h.shape[2:], pool_type="avg", name="avgpool"), name="flat")
    h = model.dense(model.dropout(h, dropout, name="dropout"), classes, name="fc")
    return model.softmax(h, name="prob")


def make_batch(rng, model, batch_size, sizes):
    """(images, labels): each class a coarse pattern of its own, plus noise."""
    return synthetic.images(rng, model.seed, batch_size, sizes["classes"], (3, sizes["image"], sizes["image"]))


#: the app: its name, graph, sizes, batches and training defaults
APP = App("inception_v3", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=8, lr=0.045,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
