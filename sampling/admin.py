"""Nothing registered yet: the policy and statistics admin come with the operators' issue."""
