"""The audit: equivalence, distribution, corruption signatures, slices, load, report."""
