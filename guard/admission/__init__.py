"""The admission flow's parts: decisions, queue, tickets, budgets, sheds."""
