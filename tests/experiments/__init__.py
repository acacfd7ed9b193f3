"""Tests of the reproduction experiments (experiments/, not installed; run from the checkout)."""
