"""The fixed English corpus the tiny models' tokenizers are trained on.

It is embedded here (not downloaded) so that a tiny model folder is built offline and byte-identical
on every machine. Changing this text changes every tiny model's tokenizer and weights.
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe this image in one sentence. What is shown in the picture? How many people are in the photo?
The image shows a small red house next to a tall green tree under a clear blue sky.
A black cat is sleeping on a wooden chair near the window, and the sun is shining on the floor.
Two children are playing football in a park while their parents watch from a bench.
There is a white dog running along the beach, with waves breaking on the sand behind it.
The chart compares the sales of three products over four years; the blue line rises every year.
A bowl of fresh fruit sits on the kitchen table: apples, oranges, bananas and a bunch of grapes.
The street is busy with cars, buses and bicycles, and people are crossing at the traffic light.
Please answer the question about the image. Is the door open or closed? The door is open.
What color is the car? The car is yellow. Where is the bird? The bird is on the roof.
Read the text in the sign. The sign says: Welcome to the city library, open from nine to five.
The document is a receipt from a grocery store with a total of twelve dollars and fifty cents.
Compare the two images. The first image is brighter than the second one, and the second is blurred.
A mountain lake reflects the snow on the peaks; a small boat floats near the shore in the morning.
The man in the blue shirt is holding an umbrella because it is raining in the city center.
Count the objects on the desk: a laptop, two pens, a cup of coffee, a notebook and a phone.
The diagram explains how water moves from the ocean to the clouds and back to the rivers.
You are a helpful assistant. Answer briefly and truthfully. If you are not sure, say so.
Hello! How can I help you today? I would like to know what is happening in this picture.
The system receives a request, checks the limits, counts the tokens and sends it to a worker.
Images are resized so that both sides are multiples of the patch size times the merge size.
Each patch becomes a vector, the vision encoder mixes them, and the merger joins four neighbours.
The language model reads the text tokens and the image tokens and writes the answer one token at a time.
A cache keeps the keys and values of earlier tokens, so the next step only computes the new token.
On Monday the weather was cold and windy; on Tuesday it was warm, and on Wednesday it rained again.
She opened the old book, read the first page aloud, and smiled at the drawing of a flying ship.
The train leaves the station at seven fifteen and arrives in the harbour town at ten past nine.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 256 1024 2048 3.14 1,000 50% #1 (a) [b] {c}
Punctuation and symbols: , . ; : ! ? - _ + = * / \\ | @ & ^ ~ ` ' " < > $
A red square, a green circle, a blue triangle and a yellow star are drawn on white paper.
The photograph was taken at night: the city lights glow, and the moon hangs above the bridge.
Question: Which animal is larger, the elephant or the mouse? Answer: The elephant is larger.
The recipe needs two eggs, a cup of flour, half a cup of milk, some sugar and a pinch of salt.
In the corner of the room stands a lamp, and on the wall hangs a painting of a sailing boat.
The robot arm picks up the box, turns it around, and places it carefully on the moving belt.
Thank you for your question. The answer depends on the details that are visible in the image.
"""
