"""The code that builds the blog: its conceptual figures and its text rendered from results."""
