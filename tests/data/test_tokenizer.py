import numpy as np

from jaxdist.data import BOS, EOS, PAD, UNK, ByteTokenizer


def test_ids_are_utf8_bytes_and_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'π ≈ 3.14' + \"😀\"\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert tok.decode(ids) == text
    assert tok.encode(text.encode("utf-8")).tolist() == ids.tolist()  # bytes in, same ids


def test_specials_and_vocab():
    tok = ByteTokenizer()
    assert (PAD, BOS, EOS, UNK, tok.vocab_size) == (256, 257, 258, 259, 260)
    ids = tok.encode("ab", bos=True, eos=True)
    assert ids.tolist() == [BOS, 97, 98, EOS]
    # Specials (and out-of-range ids) vanish from the text.
    assert tok.decode([BOS, 104, PAD, 105, UNK, EOS, 999]) == "hi"
    assert tok.decode(np.array([], np.int32)) == ""


def test_invalid_utf8_is_replaced_not_raised():
    tok = ByteTokenizer()
    cut = tok.encode("π")[:1]  # first byte of a two-byte character
    assert tok.decode(np.concatenate([tok.encode("a"), cut, tok.encode("b")])) == "a\ufffdb"
