from outlierscope.data.hellaswag import HellaSwagItem
from outlierscope.train.decontam import NgramIndex, words


def _item(i, ctx, endings=("a", "b", "c", "d")):
    return HellaSwagItem(i, "label", ctx, "", tuple(endings), 0)


def test_words_normalise():
    assert words("  The  Cat\n sat\t") == ["the", "cat", "sat"]


def test_13gram_overlap_counts_items():
    ctx = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    ending = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu"
    idx = NgramIndex.from_hellaswag([_item(0, ctx), _item(1, "short context"), _item(2, "x", ("q", ending, "r", "s"))])
    idx.scan("prefix ONE two three four five six   seven eight nine ten eleven twelve\nthirteen suffix")
    assert idx.hits == {0}
    idx.scan("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")  # only 12 words
    assert idx.hits == {0}
    idx.scan("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu.")  # punctuation sticks
    assert idx.hits == {0}
    idx.scan("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu")
    assert idx.hits == {0, 2}
