"""A plain multi-layer perceptron, the smallest app.

Paper: Srivastava, Hinton, Krizhevsky, Sutskever, Salakhutdinov, "Dropout: A Simple Way to
Prevent Neural Networks from Overfitting", JMLR 15 (2014), Table 2 (MNIST): ReLU units,
3 hidden layers of 1024, dropout 0.2 on the 784 inputs and 0.5 on the hidden units, 10
classes: 784-1024-1024-1024-10, 2,913,290 parameters. Tiny: 64-64-64-64-10.

Data: class c's samples are a fixed random template of class c (from the seed) plus unit noise.

    python -m apps.mlp [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

from apps import synthetic
from apps.cli import App, run

FULL = {"features": 784, "hidden": 1024, "layers": 3, "classes": 10, "input_dropout": 0.2, "dropout": 0.5}
TINY = {"features": 64, "hidden": 64, "layers": 3, "classes": 10, "input_dropout": 0.2, "dropout": 0.5}


def build(model, batch_size, dtype="float32", features=784, hidden=1024, layers=3, classes=10,
          input_dropout=0.2, dropout=0.5):
    """x [batch, features] -> dropout -> `layers` x (dense relu, dropout) -> dense -> softmax [batch, classes]."""
    h = model.dropout(model.input((batch_size, features), dtype, name="x"), input_dropout, name="drop_in")
    for i in range(layers):
        h = model.dropout(model.dense(h, hidden, activation="relu", name=f"fc{i + 1}"), dropout, name=f"drop{i + 1}")
    return model.softmax(model.dense(h, classes, name="out"), name="prob")


def make_batch(rng, model, batch_size, sizes):
    """(x, labels): a class's template plus unit noise."""
    return synthetic.vectors(rng, model.seed, batch_size, sizes["classes"], sizes["features"])


#: the app: its name, graph, sizes, batches and training defaults
APP = App("mlp", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, lr=0.01,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
