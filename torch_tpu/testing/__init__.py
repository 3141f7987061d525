"""Test helpers shared by the suite and the coverage tools."""
