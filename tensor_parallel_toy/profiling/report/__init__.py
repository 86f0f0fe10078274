"""Reporting: the ranks' numbers turned into results.json's sections, the printed summary and
the targets checked against them (the targets themselves are data: targets.json), the
pictures, and the atomic file writes every output goes through."""
