"""RNNTC: recurrent text classification, one of the RNN benchmarks of the FlexFlow paper.

Paper: Jia, Zaharia and Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks"
(SysML 2019), Table 3: "4 recurrent layers followed by a softmax layer", trained on the Movie
Reviews sentence polarity data (Pang and Lee, 2005). The network: word embedding, 4 stacked
LSTM layers, and a dense layer over the last step's hidden state whose softmax (fused into the
loss, which reads logits) gives the class probabilities.

Configuration (FULL): 4 LSTM layers of 1024 units over 1024-wide embeddings, the RNN size of
FlexFlow's own RNN code of the paper's time (scripts/simulator.cc, and nmt/nmt.cc of April
2018: hidden and embedding 1024, sequence length 40); a vocabulary of 18,765 words and 2 classes, the Movie
Reviews figures of Kim, "Convolutional Neural Networks for Sentence Classification" (EMNLP
2014), Table 1; sequences of 40 words, the paper's unrolling length: 52,804,610 parameters.
TINY: the same 4 layers at 16 units, 40 words, sequences of 10.

Data: words 0..2C-1 are "sentiment" words (two per class), the rest neutral; a sequence of
class c has a quarter of its positions (at least one) in class c's words, at random places.

    python -m apps.rnntc [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

from apps.cli import App, run

SEQ_LENGTH = 40
FULL = {"vocab_size": 18765, "embed_size": 1024, "hidden_size": 1024, "num_layers": 4, "num_classes": 2,
        "seq_length": SEQ_LENGTH}
TINY = {"vocab_size": 40, "embed_size": 16, "hidden_size": 16, "num_layers": 4, "num_classes": 2, "seq_length": 10}


def build(model, batch_size, dtype="float32", vocab_size=18765, embed_size=1024, hidden_size=1024, num_layers=4,
          num_classes=2, seq_length=SEQ_LENGTH):
    """tokens [batch, seq] -> embedding -> `num_layers` LSTMs -> dense over the last hidden state:
    the class logits [batch, classes]. The embedding computes in float32 whatever `dtype` says."""
    if vocab_size < 2 * num_classes + 1:
        raise ValueError(f"rnntc: vocab_size {vocab_size} leaves no neutral words for {num_classes} classes "
                         f"(needs at least {2 * num_classes + 1})")
    tokens = model.input((batch_size, seq_length), "int64", name="tokens")
    h = model.embedding(tokens, vocab_size, embed_size, name="embedding")
    for i in range(num_layers):
        h, last, _ = model.lstm(h, hidden_size, name=f"lstm_{i}")
    return model.dense(last, num_classes, name="classifier")


def make_batch(rng, model, batch_size, sizes):
    """(tokens [batch, seq], labels [batch]): neutral words with a quarter of the places taken
    by the sentiment words of the label's class."""
    k, length = sizes["num_classes"], sizes["seq_length"]
    labels = rng.integers(0, k, batch_size)
    tokens = rng.integers(2 * k, sizes["vocab_size"], (batch_size, length))
    marks = max(1, length // 4)
    for i in range(batch_size):
        where = rng.choice(length, marks, replace=False)
        tokens[i, where] = 2 * labels[i] + rng.integers(0, 2, marks)
    return tokens, labels


#: the app: its name, graph, sizes, batches and training defaults
APP = App("rnntc", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, optimizer="adam",
          lr=0.001, tiny_lr=0.01,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
