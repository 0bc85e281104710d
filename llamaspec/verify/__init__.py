"""Verification of a draft against the target.

- :mod:`~llamaspec.verify.rules`: the rules as pure functions (sample-and-match, replay, rejection sampling).
- :mod:`~llamaspec.verify.verifiers`: one verifier object per request (match, rejection, synthetic), each with
  ``verify`` and ``replay``, bound to the request's target sampler and the round's output rows.
"""
from .rules import VerifyResult, rejection_verify, replay, sample_and_match, sample_from_probs

__all__ = [
    "VerifyResult",
    "sample_and_match",
    "replay",
    "rejection_verify",
    "sample_from_probs",
]
