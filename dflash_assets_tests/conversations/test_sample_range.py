"""Partition keys: the format other tools read, and stability as the dataset grows."""

import pytest

from dflash_assets.conversations.sample_range import SampleRange, range_containing, sample_ranges


def test_keys_are_zero_padded_to_eight_digits_with_an_inclusive_end():
    assert SampleRange(0, 9999).key == "00000000-00009999"
    assert SampleRange(910000, 919999).key == "00910000-00919999"
    assert len(SampleRange(0, 9999)) == 10000
    assert 9999 in SampleRange(0, 9999) and 10000 not in SampleRange(0, 9999)


def test_parse_is_the_inverse_of_key():
    for r in [SampleRange(0, 0), SampleRange(100, 199), SampleRange(12345678, 99999999)]:
        assert SampleRange.parse(r.key) == r


@pytest.mark.parametrize("bad", ["0-9999", "00000000_00009999", "00000010-00000009", "", "abcdefgh-00000001"])
def test_malformed_keys_are_rejected_with_the_expected_format_named(bad):
    with pytest.raises(ValueError) as error:
        SampleRange.parse(bad)
    assert repr(bad) in str(error.value) or "invalid sample range" in str(error.value)


def test_ranges_have_a_fixed_size_and_cover_the_dataset():
    ranges = list(sample_ranges(25, 10))
    assert [r.key for r in ranges] == ["00000000-00000009", "00000010-00000019", "00000020-00000029"]
    covered = {i for r in ranges for i in r.indices()}
    assert set(range(25)) <= covered


def test_existing_keys_do_not_change_when_the_dataset_grows():
    before = [r.key for r in sample_ranges(25, 10)]
    after = [r.key for r in sample_ranges(41, 10)]
    assert after[: len(before)] == before
    assert range_containing(23, 10) == SampleRange(20, 29)
