"""AlexNet on 3x224x224 images, 1000 classes.

Papers: Krizhevsky, Sutskever, Hinton, "ImageNet Classification with Deep Convolutional
Neural Networks", NIPS 2012 (the architecture: five convolutions, three max pools, three
fully connected layers with dropout 0.5), in one tower, as torchvision and FlexFlow's simulator
have it (cuda-convnet2's single-GPU widths; Krizhevsky's "One weird trick", arXiv:1404.5997,
gives conv4 384 filters): no local response normalization, and dropout before fc6 and fc7:

    conv 64 11x11/4 pad 2, relu, maxpool 3/2      conv 192 5x5 pad 2, relu, maxpool 3/2
    conv 384 3x3 pad 1, relu    conv 256 3x3 pad 1, relu    conv 256 3x3 pad 1, relu, maxpool 3/2
    dropout, fc 4096, relu, dropout, fc 4096, relu, fc 1000          61,100,840 parameters

Tiny: the same layers at 3x64x64 with a quarter of the channels (16, 48, 96, 64, 64), fc 256, 4 classes.
Data: class c is a coarse random pattern of its own stretched over the image, plus noise.

    python -m apps.alexnet [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

from apps import synthetic
from apps.cli import App, run

FULL = {"image": 224, "channels": (64, 192, 384, 256, 256), "hidden": 4096, "classes": 1000, "dropout": 0.5}
TINY = {"image": 64, "channels": (16, 48, 96, 64, 64), "hidden": 256, "classes": 4, "dropout": 0.5}


def build(model, batch_size, dtype="float32", image=224, channels=(64, 192, 384, 256, 256), hidden=4096,
          classes=1000, dropout=0.5):
    """images [batch, 3, image, image] -> class probabilities [batch, classes]."""
    c1, c2, c3, c4, c5 = channels
    h = model.input((batch_size, 3, image, image), dtype, name="images")
    h = model.relu(model.conv2d(h, c1, 11, stride=4, padding=2, name="conv1"), name="relu1")
    h = model.pool2d(h, 3, 2, name="pool1")
    h = model.relu(model.conv2d(h, c2, 5, padding=2, name="conv2"), name="relu2")
    h = model.pool2d(h, 3, 2, name="pool2")
    h = model.relu(model.conv2d(h, c3, 3, padding=1, name="conv3"), name="relu3")
    h = model.relu(model.conv2d(h, c4, 3, padding=1, name="conv4"), name="relu4")
    h = model.relu(model.conv2d(h, c5, 3, padding=1, name="conv5"), name="relu5")
    h = model.flat(model.pool2d(h, 3, 2, name="pool5"), name="flat")
    h = model.dense(model.dropout(h, dropout, name="drop6"), hidden, activation="relu", name="fc6")
    h = model.dense(model.dropout(h, dropout, name="drop7"), hidden, activation="relu", name="fc7")
    return model.softmax(model.dense(h, classes, name="fc8"), name="prob")


def make_batch(rng, model, batch_size, sizes):
    """(images, labels): each class a coarse pattern of its own, plus noise."""
    return synthetic.images(rng, model.seed, batch_size, sizes["classes"], (3, sizes["image"], sizes["image"]))


#: the app: its name, graph, sizes, batches and training defaults
APP = App("alexnet", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, lr=0.01,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
