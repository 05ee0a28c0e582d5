"""Medusa speculation for Sonar: independent heads that each predict one token further ahead."""
