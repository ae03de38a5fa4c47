"""Capacity planning: `epd profile` measures this hardware's costs, `epd plan` predicts a traffic mix's needs."""
