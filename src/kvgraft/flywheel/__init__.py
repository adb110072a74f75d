"""Solve, verify, store, measure: problems and answers, data sets, harvest, the bench ladder, reports, the demo."""
