"""Experience makers: the experience maker (generate, score, advantages), the maker actor over it,
and the optional vLLM engine."""
