"""NMT: neural machine translation with attention, one of the RNN benchmarks of the FlexFlow paper.

Paper: Jia, Zaharia and Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks"
(SysML 2019), Table 3: "4 recurrent layers followed by an attention and a softmax layer" on WMT
English-German, after Wu et al., "Google's Neural Machine Translation System" (GNMT, 2016).
The network, trained with teacher forcing:
- encoder: source embedding and 2 stacked LSTM layers;
- decoder: target embedding and 2 stacked LSTM layers, layer i starting from encoder layer i's
  final state (as FlexFlow's nmt/rnn.cu chains them);
- attention over the encoder outputs as in Luong, Pham and Manning, "Effective Approaches to
  Attention-based Neural Machine Translation" (2015), global attention with the dot score:
  a_t = softmax over source positions s of h_t . h_s, c_t = sum_s a_t[s] h_s, and the
  attentional state tanh(W_c [c_t; h_t]) (W_c without bias);
- at every step a dense layer over the target vocabulary whose softmax (fused into the loss,
  which reads logits) predicts the next target word.

Configuration (FULL): GNMT's 1024 LSTM units and 32K word-piece vocabularies, 1024-wide
embeddings, 2 encoder and 2 decoder layers: the sizes of FlexFlow's own NMT code of the
paper's time (scripts/simulator.cc: 2 layers, hidden and embedding 1024, vocabulary 32000,
40 steps as 5 nodes of 8; nmt/nmt.cc of April 2018 had 1024 and 40 with a vocabulary of
32 x 1024, and from July 2018 2048, 20,480 and 20); source and target sentences of 40 words:
134,020,352 parameters. TINY: the same network at 16 units, 24 words, sentences of 8.

Data: source words are uniform over 1..V-1; the target is the source translated word by word
through a fixed random dictionary (from the model's seed); the decoder reads the target
shifted right behind BOS (word 0).

    python -m apps.nmt [--tiny] [--batch-size 64] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

import functools

import numpy as np

from apps.cli import App, run

SEQ_LENGTH = 40
#: the decoder's first input word (beginning of sentence); data words are 1..vocab-1
BOS = 0
FULL = {"src_vocab_size": 32000, "tgt_vocab_size": 32000, "embed_size": 1024, "hidden_size": 1024,
        "num_layers": 2, "seq_length": SEQ_LENGTH}
TINY = {"src_vocab_size": 24, "tgt_vocab_size": 24, "embed_size": 16, "hidden_size": 16, "num_layers": 2,
        "seq_length": 8}


def build(model, batch_size, dtype="float32", src_vocab_size=32000, tgt_vocab_size=32000, embed_size=1024,
          hidden_size=1024, num_layers=2, seq_length=SEQ_LENGTH):
    """source and target_in words [batch, seq] -> encoder, decoder, attention -> the target-word
    logits [batch, seq, tgt_vocab]; num_layers LSTMs on each side. The embeddings compute in
    float32 whatever `dtype` says."""
    if min(src_vocab_size, tgt_vocab_size) < 2:
        raise ValueError(f"nmt: vocabularies need a word besides BOS, got {src_vocab_size} and {tgt_vocab_size}")
    source = model.input((batch_size, seq_length), "int64", name="source")
    target_in = model.input((batch_size, seq_length), "int64", name="target_in")

    enc = model.embedding(source, src_vocab_size, embed_size, name="src_embedding")
    states = []
    for i in range(num_layers):
        enc, h_n, c_n = model.lstm(enc, hidden_size, name=f"encoder_lstm_{i}")
        states.append((h_n, c_n))
    dec = model.embedding(target_in, tgt_vocab_size, embed_size, name="tgt_embedding")
    for i, (h0, c0) in enumerate(states):
        dec, _, _ = model.lstm(dec, hidden_size, h0=h0, c0=c0, name=f"decoder_lstm_{i}")

    keys = model.transpose(enc, (0, 2, 1), name="attention_keys")              # [b, hidden, src]
    scores = model.batch_matmul(dec, keys, name="attention_scores")            # [b, tgt, src]
    weights = model.softmax(scores, name="attention_weights")
    context = model.batch_matmul(weights, enc, name="attention_context")       # [b, tgt, hidden]
    joined = model.concat([context, dec], axis=2, name="attention_concat")
    attentional = model.dense(joined, hidden_size, use_bias=False, activation="tanh", name="attention_combine")
    return model.dense(attentional, tgt_vocab_size, name="decoder_output")


@functools.lru_cache(maxsize=8)
def dictionary(seed: int, src_vocab_size: int, tgt_vocab_size: int) -> np.ndarray:
    """The target word of each source word (BOS to BOS), from the seed alone."""
    words = 1 + np.random.default_rng([seed, 41]).permutation(tgt_vocab_size - 1)
    return np.concatenate([[BOS], words[np.arange(src_vocab_size - 1) % (tgt_vocab_size - 1)]])


def make_batch(rng, model, batch_size, sizes):
    """({'source', 'target_in'} [batch, seq], target words [batch, seq])."""
    length = sizes["seq_length"]
    source = rng.integers(1, sizes["src_vocab_size"], (batch_size, length))
    target = dictionary(model.seed, sizes["src_vocab_size"], sizes["tgt_vocab_size"])[source]
    target_in = np.concatenate([np.full((batch_size, 1), BOS, np.int64), target[:, :-1]], axis=1)
    return {"source": source, "target_in": target_in}, target


#: the app: its name, graph, sizes, batches and training defaults
APP = App("nmt", build, FULL, TINY, make_batch, batch_size=64, tiny_batch_size=16, optimizer="adam",
          lr=0.001, tiny_lr=0.01,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
