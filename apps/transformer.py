"""A BERT-base-like Transformer encoder stack with a sequence classifier, 128-token inputs.

Paper: Devlin, Chang, Lee, Toutanova, "BERT: Pre-training of Deep Bidirectional Transformers
for Language Understanding", NAACL 2019, BERT-base: L = 12 layers, H = 768, A = 12 heads,
feed-forward 4H = 3072 with GELU, WordPiece vocabulary of 30,522, 512 learned positions and
2 token types, post-layer-norm residual blocks (Vaswani et al. 2017) with layer norm eps
1e-12 and dropout 0.1; the pooler (tanh dense on the first token) and a 2-class classifier,
as for sequence-pair tasks. 109,482,240 parameters in the encoder with its embeddings and
pooler (the "110M"), 109,483,778 with the classifier. Sequences of 128 tokens, the length of
BERT's first pre-training phase. Attention probabilities are not dropped out (the attention
op has no dropout); everything else follows the paper.

Tiny: 2 layers, H = 32, 2 heads, feed-forward 128, a vocabulary of 1000, 64 positions,
16-token sequences, 4 classes. Data: random filler tokens with one marker token, whose id
gives the label, at a random position; every sequence starts with a [CLS] token (id 0).

    python -m apps.transformer [--tiny] [--batch-size 32] [--iterations 10] ...   (--help for all flags)
"""
from __future__ import annotations

import numpy as np

from apps import synthetic
from apps.cli import App, run

FULL = {"vocab": 30522, "positions": 512, "types": 2, "hidden": 768, "layers": 12, "heads": 12, "ff": 3072,
        "seq_len": 128, "classes": 2, "dropout": 0.1, "eps": 1e-12}
TINY = {"vocab": 1000, "positions": 64, "types": 2, "hidden": 32, "layers": 2, "heads": 2, "ff": 128,
        "seq_len": 16, "classes": 4, "dropout": 0.1, "eps": 1e-12}
CLS = 0


def encoder_layer(model, h, heads, ff, dropout, eps, name):
    """Post-LN block: h = LN(h + drop(attention(h))); h = LN(h + drop(dense(gelu(dense(h)))))."""
    a = model.multihead_attention(h, num_heads=heads, name=f"{name}.attention")
    h = model.layer_norm(model.add(h, model.dropout(a, dropout, name=f"{name}.attention_drop"),
                                   name=f"{name}.attention_add"), eps=eps, name=f"{name}.attention_norm")
    f = model.dense(h, ff, activation="gelu", name=f"{name}.intermediate")
    f = model.dense(f, h.shape[-1], name=f"{name}.output")
    return model.layer_norm(model.add(h, model.dropout(f, dropout, name=f"{name}.output_drop"),
                                      name=f"{name}.output_add"), eps=eps, name=f"{name}.output_norm")


def build(model, batch_size, dtype="float32", vocab=30522, positions=512, types=2, hidden=768, layers=12, heads=12,
          ff=3072, seq_len=128, classes=2, dropout=0.1, eps=1e-12):
    """tokens, segments, positions [batch, seq_len] (int64) -> class probabilities [batch, classes].

    The network computes in float32 (its embeddings' type) whatever `dtype` says."""
    shape = (batch_size, seq_len)
    tokens = model.input(shape, "int64", name="tokens")
    segments = model.input(shape, "int64", name="segments")
    places = model.input(shape, "int64", name="positions")
    h = model.add(model.embedding(tokens, vocab, hidden, name="word_embeddings"),
                  model.embedding(places, positions, hidden, name="position_embeddings"), name="embeddings.add1")
    h = model.add(h, model.embedding(segments, types, hidden, name="token_type_embeddings"), name="embeddings.add2")
    h = model.dropout(model.layer_norm(h, eps=eps, name="embeddings.norm"), dropout, name="embeddings.drop")
    for i in range(layers):
        h = encoder_layer(model, h, heads, ff, dropout, eps, name=f"layer{i}")
    first = model.flat(model.split(h, [1, seq_len - 1], axis=1, name="first_token")[0], name="cls")
    pooled = model.dense(first, hidden, activation="tanh", name="pooler")
    logits = model.dense(model.dropout(pooled, dropout, name="classifier_drop"), classes, name="classifier")
    return model.softmax(logits, name="prob")


def make_batch(rng, model, batch_size, sizes):
    """({tokens, segments, positions}, labels): [CLS], then filler tokens and one marker (id 2 + label);
    the first half of each sequence is segment 0, the rest segment 1."""
    seq, classes = sizes["seq_len"], sizes["classes"]
    tokens, labels = synthetic.marked_tokens(rng, batch_size, seq, sizes["vocab"], classes, first_filler=2 + classes)
    tokens[:, 0] = CLS
    segments = np.broadcast_to((np.arange(seq) >= seq // 2).astype(np.int64), (batch_size, seq))
    positions = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch_size, seq))
    return {"tokens": tokens, "segments": segments, "positions": positions}, labels


#: the app: its name, graph, sizes, batches and training defaults
APP = App("transformer", build, FULL, TINY, make_batch, batch_size=32, tiny_batch_size=8, optimizer="adam", lr=1e-4,
          description=__doc__.splitlines()[0])


def main(argv=None) -> dict:
    return run(APP, argv)


if __name__ == "__main__":
    main()
