"""Word errors: punctuation and case do not count, substitutions/insertions/deletions do."""

from speech.word_errors import word_error_rate, word_errors


def test_punctuation_case_and_hyphens_are_not_errors():
    assert word_errors("Apply with form HR-01.", "apply with form hr 01") == (0, 5)


def test_edits_count_once_each():
    assert word_errors("how do I apply for leave", "how I apply for annual leave") == (2, 6)  # one deletion, one insertion
    assert word_error_rate("twenty days", "thirty days") == 0.5
    assert word_error_rate("", "anything") == 1.0  # no reference words: every hypothesis word is an error
