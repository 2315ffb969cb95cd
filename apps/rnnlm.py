"""RNNLM: a recurrent word-level language model, one of the RNN benchmarks of the FlexFlow paper.

Paper: Jia, Zaharia and Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks"
(SysML 2019), Table 3: "2 recurrent layers followed by a softmax layer" on the Penn Treebank,
after Zaremba, Sutskever and Vinyals, "Recurrent Neural Network Regularization" (2014), whose
large model's test perplexity (78.4) is the figure the paper reports. The network: word
embedding, 2 stacked LSTM layers, and at every step a dense layer over the vocabulary whose
softmax (fused into the loss, which reads logits) predicts the next word.

Configuration (FULL): Zaremba et al.'s large model, 2 LSTM layers of 1500 units over 1500-wide
embeddings and a 10,000-word vocabulary: 66,034,000 parameters (their "66M"); sequences of 40
words, the FlexFlow paper's unrolling length (Zaremba et al. unroll 35). Their dropout is
regularization, not a layer, and is left out, as in the FlexFlow paper's description.
TINY: the same 2 layers at 16 units, 32 words, sequences of 10.

Data: a Markov chain over the words: the next word is perm[word] (a fixed random permutation
from the model's seed) four times in five, a uniform draw otherwise.

    python -m apps.rnnlm [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

import functools

import numpy as np

from apps.cli import App, run

SEQ_LENGTH = 40
FULL = {"vocab_size": 10000, "embed_size": 1500, "hidden_size": 1500, "num_layers": 2, "seq_length": SEQ_LENGTH}
TINY = {"vocab_size": 32, "embed_size": 16, "hidden_size": 16, "num_layers": 2, "seq_length": 10}


def build(model, batch_size, dtype="float32", vocab_size=10000, embed_size=1500, hidden_size=1500, num_layers=2,
          seq_length=SEQ_LENGTH):
    """words [batch, seq] -> embedding -> `num_layers` LSTMs -> dense at every step: the next-word
    logits [batch, seq, vocab]. The embedding computes in float32 whatever `dtype` says."""
    words = model.input((batch_size, seq_length), "int64", name="words")
    h = model.embedding(words, vocab_size, embed_size, name="embedding")
    for i in range(num_layers):
        h, _, _ = model.lstm(h, hidden_size, name=f"lstm_{i}")
    return model.dense(h, vocab_size, name="decoder")


@functools.lru_cache(maxsize=8)
def successor(seed: int, vocab_size: int) -> np.ndarray:
    """The chain's usual next word of each word, from the seed alone."""
    return np.random.default_rng([seed, 29]).permutation(vocab_size)


def make_batch(rng, model, batch_size, sizes):
    """(words [batch, seq], next words [batch, seq]): runs of the Markov chain."""
    vocab, length = sizes["vocab_size"], sizes["seq_length"]
    perm = successor(model.seed, vocab)
    text = np.empty((batch_size, length + 1), np.int64)
    text[:, 0] = rng.integers(0, vocab, batch_size)
    for t in range(length):
        follow = rng.random(batch_size) < 0.8
        text[:, t + 1] = np.where(follow, perm[text[:, t]], rng.integers(0, vocab, batch_size))
    return text[:, :-1], text[:, 1:]


#: the app: its name, graph, sizes, batches and training defaults
APP = App("rnnlm", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, optimizer="adam",
          lr=0.001, tiny_lr=0.01,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
